"""Pipeline-runner benchmarks, one torchrun per pipeline depth (every rank a stage)::

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py
    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline.py

bubble: measured idle fraction of each schedule against (p-1)/(m+p-1), for
  m = 4, 8, 16. A stage's idle fraction is 1 - (time in its forwards and
  backwards) / (step time), averaged over stages (pycomm's Pipeline.stats()).
  The layers sleep (forward t, backward 2t) instead of computing, so that p
  stages measure the schedule and its communication even where p exceeds the
  cores; activations are real tensors that travel between stages.
memory: peak bytes of activations kept for backward on each stage
  (autograd's saved tensors, parameters excluded), 1F1B against GPipe, for a
  real MLP; theory says stage s holds min(p - s, m) micro-batches under 1F1B
  and m under GPipe, so the largest ratio is p/m (stage 0).
throughput: batches per second of a real MLP with pycomm's runner and with
  torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B on gloo): same
  model, ranks, micro-batches and data, interleaved rounds, median step
  times. The first step's loss of both runners must agree (#wrong counts
  disagreements).
p2p (on request): one-way time of a ping-pong between ranks 0 and 1 through
  pycomm's channel and through gloo's send/recv, with the echo checked:
  --p2p-mode barrier (a barrier before each round trip), back-to-back, or
  idle (the receiver idles 2 ms before each).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pycomm
from pycomm.pipeline import Pipeline, bubble_theory, stage_layers


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


class _Sleep(torch.autograd.Function):
    # The scale parameter is an input, so backward runs (and sleeps) on the
    # first stage too, whose input needs no gradient.
    @staticmethod
    def forward(ctx, x, scale, seconds):
        ctx.seconds = seconds
        ctx.save_for_backward(x, scale)
        time.sleep(seconds)
        return x * scale

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        time.sleep(2 * ctx.seconds)
        return g * scale, (g * x).sum(), None


class SleepLayer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x, self.scale, self.seconds)


def mlp_layers(width: int, depth: int, seed: int = 0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return layers


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def bench_bubble(comm, p, args, sleep_ms):
    log(f"\n## bubble: {p} stages, sleeping layers ({sleep_ms:g} ms forward, {2 * sleep_ms:g} ms backward "
        f"per micro-batch), activations {args.batch}x{args.width} float32")
    log("| schedule | m | theory | measured | measured - theory | measured / theory |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            per_mb = sleep_ms / 1000.0
            module = stage_layers([SleepLayer(per_mb)], 0, 1)
            pipe = Pipeline(module, comm, num_microbatches=m, schedule=schedule, loss_fn=lambda o, t: o.mean())
            x = torch.randn(args.batch * m, args.width)
            bubbles = []
            for i in range(args.steps + 1):
                pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
                if i:  # the first step includes the channels' set-up
                    bubbles.append(pipe.stats()["bubble"])
            mine = statistics.median(bubbles)
            measured = statistics.mean(gather(mine))
            theory = bubble_theory(p, m)
            rows.append((schedule, m, theory, measured))
            log(f"| {schedule} | {m} | {theory:.3f} | {measured:.3f} | {measured - theory:+.3f} | "
                f"{measured / theory:.2f} |")
    return rows


def bench_memory(comm, p, args):
    log(f"\n## activation memory: {p} stages, MLP width {args.width}, {args.depth} layers, "
        f"micro-batch {args.batch} rows")
    log("| m | stage | GPipe peak (MiB) | 1F1B peak (MiB) | 1F1B / GPipe | p/m |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: |")
    layers = mlp_layers(args.width, args.depth)
    for m in (8, 16):
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            module = stage_layers(layers, comm.rank, p)
            pipe = Pipeline(module, comm, num_microbatches=m, schedule=schedule, loss_fn=nn.functional.mse_loss,
                            track_memory=True)
            x = torch.randn(args.batch * m, args.width)
            pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
            peaks[schedule] = pipe.stats()["peak_activation_bytes"]
        for s, (g, o) in enumerate(gather((peaks["gpipe"], peaks["1f1b"]))):
            log(f"| {m} | {s} | {g / 2**20:.1f} | {o / 2**20:.1f} | {o / g:.3f} | {p / m:.3f} |")


def bench_throughput(comm, p, args):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m = args.microbatches
    log(f"\n## throughput: {p} stages, MLP width {args.width}, {args.depth} layers, batch {args.batch * m} "
        f"in {m} micro-batches, {args.steps} steps x {args.rounds} rounds")
    log("| schedule | torch.distributed.pipelining (ms/step) | pycomm (ms/step) | speed-up | #wrong |")
    log("| --- | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch * m, args.width, generator=gen)
    y = torch.randn(args.batch * m, args.width, generator=gen)
    results = []
    for name, torch_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = stage_layers(mlp_layers(args.width, args.depth), comm.rank, p)
        theirs = stage_layers(mlp_layers(args.width, args.depth), comm.rank, p)
        pipe = Pipeline(ours, comm, num_microbatches=m, schedule=name, loss_fn=nn.functional.mse_loss)
        stage = PipelineStage(theirs, comm.rank, p, torch.device("cpu"))
        sched = torch_cls(stage, m, loss_fn=nn.functional.mse_loss)
        first, last = comm.rank == 0, comm.rank == p - 1

        def run_ours():
            ours.zero_grad()
            return pipe.step(x if first else None, y if last else None)

        def run_theirs():
            theirs.zero_grad()
            losses = []
            if first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            return torch.stack(losses).mean() if last else None

        # Correctness: both runners give the same first loss and gradients.
        a, b = run_ours(), run_theirs()
        wrong = 0
        if last and abs(a.item() - b.item()) > 1e-5 * max(1.0, abs(b.item())):
            wrong += 1
        for pa, pb in zip(ours.parameters(), theirs.parameters()):
            if not torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6):
                wrong += 1
        t_ours, t_theirs = [], []
        for _ in range(args.rounds):
            for fn, acc in ((run_theirs, t_theirs), (run_ours, t_ours)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                dist.barrier()
                acc.append((time.perf_counter() - t0) / args.steps)
        ours_ms, theirs_ms = statistics.median(t_ours) * 1e3, statistics.median(t_theirs) * 1e3
        wrong = sum(gather(wrong))
        results.append((name, theirs_ms, ours_ms, wrong))
        log(f"| {name} | {theirs_ms:.1f} | {ours_ms:.1f} | {theirs_ms / ours_ms:.2f}x | {wrong} |")
    return results


def bench_p2p(comm, p, args):
    """Ping-pong between ranks 0 and 1: pycomm's channel against gloo's send/recv."""
    log(f"\n## point-to-point ({args.p2p_mode}): ranks 0 and 1, one message each way per round trip (median of "
        f"{args.steps * args.rounds})")
    log("| size (B) | gloo (us) | pycomm (us) | gloo GB/s | pycomm GB/s | speed-up | #wrong |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rank = comm.rank
    for size in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20):
        n = size // 4
        msg = torch.randn(n, generator=torch.Generator().manual_seed(size))
        buf = torch.empty(n)
        wrong = 0

        def ours():
            if rank == 0:
                comm.send(msg, 1)
                comm.recv(1, out=buf)
            elif rank == 1:
                comm.recv(0, out=buf)
                comm.send(buf, 0)

        def theirs():
            if rank == 0:
                dist.send(msg, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        times = {}
        for name, fn in (("gloo", theirs), ("pycomm", ours)):
            fn()  # warm-up, then check what came back
            if rank == 0 and not torch.equal(buf, msg):
                wrong += 1
            samples = []
            if args.p2p_mode == "barrier":
                # Each round trip starts after a barrier (includes the barrier's skew).
                for _ in range(args.steps * args.rounds):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
            else:
                # Back to back: batches of round trips with nothing in between; "idle": before each
                # round trip rank 1 idles 2 ms (as between pipeline hops) and rank 0 waits as long,
                # so the receiver has gone to sleep when the message comes.
                idle = args.p2p_mode == "idle"
                reps = 1 if idle else 20
                for _ in range(args.steps * args.rounds):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        if idle:
                            time.sleep(0.002)
                            t0 = time.perf_counter()
                        fn()
                    samples.append((time.perf_counter() - t0) / reps)
            times[name] = statistics.median(samples) / 2  # one way
        wrong = sum(gather(wrong))
        g, o = times["gloo"], times["pycomm"]
        log(f"| {size} | {g * 1e6:.0f} | {o * 1e6:.0f} | {size / g / 1e9:.2f} | {size / o / 1e9:.2f} | "
            f"{g / o:.2f}x | {wrong} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modes", nargs="*", default=["bubble", "memory", "throughput"],
                    help="bubble, memory, throughput (default: all three), p2p")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8, help="Linear+ReLU pairs (throughput, memory)")
    ap.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--microbatches", type=int, default=8, help="throughput")
    ap.add_argument("--sleep-ms", default="10,40", help="bubble: forward times per micro-batch (ms, comma-separated)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p2p-mode", default="barrier", choices=["barrier", "back-to-back", "idle"],
                    help="p2p: a barrier before each round trip, round trips back to back, or the "
                         "receiver idle 2 ms before each")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p = dist.get_world_size()
    comm = pycomm.Communicator()
    log(f"# pipeline benchmarks: {p} stages, torch {torch.__version__}")
    if "p2p" in args.modes:
        bench_p2p(comm, p, args)
    if "bubble" in args.modes:
        for sleep_ms in args.sleep_ms.split(","):
            bench_bubble(comm, p, args, float(sleep_ms))
    if "memory" in args.modes:
        bench_memory(comm, p, args)
    if "throughput" in args.modes:
        bench_throughput(comm, p, args)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
