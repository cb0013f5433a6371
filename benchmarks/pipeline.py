"""Pipeline-runner benchmarks, one torchrun per pipeline depth (every rank a stage)::

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py
    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline.py

Schedules: gpipe, 1f1b, zb-h1 (one stage per rank), interleaved-1f1b,
interleaved-zb, zbv (two per rank).

bubble: measured idle fraction of each schedule against its ideal (the
  simulation of equal stages with free transfers: (p-1)/(m+p-1) for GPipe
  and 1F1B, (p-1)/(vm+p-1) interleaved, (p-1)/(3vm+p-1) zero bubble), for
  m = 4, 8, 16. A rank's idle fraction is 1 - (time in its F, B and W) /
  (step time), averaged over ranks (Pipeline.stats()). The layers sleep
  (forward t, input gradient t, weight gradient t per rank; a chunk of an
  interleaved schedule t/v) instead of computing, so that p stages measure
  the schedule and its communication even where p exceeds the cores;
  activations are real tensors that travel between stages.
memory: peak bytes of activations kept for backward per rank (autograd's
  saved tensors, parameters excluded; zero bubble: plus the output gradients
  kept for W), every schedule against 1F1B, for a real MLP.
throughput: ms per step of a real MLP with pycomm's runner and with
  torch.distributed.pipelining (on gloo) for every schedule both have: same
  model, ranks, micro-batches and data, interleaved rounds, median step
  times. The first step's loss and every gradient of both runners must agree
  (#wrong counts disagreements).
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
from pycomm.pipeline import Pipeline, get_schedule, simulate, stage_layers, stages_of


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


class _SleepBackward(torch.autograd.Function):
    """Identity that sleeps in its backward (and, with ``forward_seconds``, in its forward)."""

    @staticmethod
    def forward(ctx, x, seconds, forward_seconds):
        ctx.seconds = seconds
        time.sleep(forward_seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None, None


class SleepLayer(nn.Module):
    """out = x * scale, costing t in the forward, t for the gradient of x
    and t for the gradient of scale: a full backward sleeps 2t, and a
    zero-bubble schedule's B and W t each (each gradient has its own
    branch, and autograd runs only the branches a call asks for). The
    first stage's input must require a gradient for its B to cost t too."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        s = self.scale
        through_x = _SleepBackward.apply(x, self.seconds, self.seconds) * s.detach()
        through_scale = x.detach() * _SleepBackward.apply(s - s.detach(), self.seconds, 0.0)
        return through_x + through_scale


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


# (name in pycomm, stages per rank, torch.distributed.pipelining class or None)
SCHEDULE_TABLE = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"), ("zb-h1", 1, None),
                  ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
                  ("interleaved-zb", 2, "ScheduleInterleavedZeroBubble"), ("zbv", 2, "ScheduleZBVZeroBubble")]


def ideal_bubble(name, v, p, m):
    """The schedule's bubble on an ideal pipeline with equal stages and free
    transfers, F = t, B + W = 2t per stage (a chunk: 1/v of that). Equals
    (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, and with
    B = W: (p-1)/(3vm+p-1) for ZB-H1 and interleaved zero bubble (tested in
    tests/test_pipeline.py); for ZB-V it is what the simulation gives."""
    return simulate(get_schedule(name, None if v == 1 else v), p, m, forward_time=1.0 / v,
                    backward_time=2.0 / v).bubble


def bench_bubble(comm, p, args, sleep_ms):
    log(f"\n## bubble: {p} stages, sleeping layers ({sleep_ms:g} ms forward, {sleep_ms:g} + {sleep_ms:g} ms "
        f"backward (input + weight) per micro-batch and rank), activations {args.batch}x{args.width} float32")
    log("| schedule | v | m | theory | measured | measured - theory | measured / theory |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for schedule, v, _ in SCHEDULE_TABLE:
        if args.schedules and schedule not in args.schedules:
            continue
        for m in (4, 8, 16):
            per_chunk = sleep_ms / 1000.0 / v
            fn = get_schedule(schedule, None if v == 1 else v)
            modules = [stage_layers([SleepLayer(per_chunk)], 0, 1) for _ in stages_of(fn, p, comm.rank)]
            pipe = Pipeline(modules if v > 1 else modules[0], comm, num_microbatches=m, schedule=fn,
                            loss_fn=lambda o, t: o.mean())
            x = torch.randn(args.batch * m, args.width).requires_grad_()
            bubbles = []
            for i in range(args.steps + 1):
                pipe.step(x if pipe.is_first else None, x.detach() if pipe.is_last else None)
                if i:  # the first step includes the channels' set-up
                    bubbles.append(pipe.stats()["bubble"])
            mine = statistics.median(bubbles)
            measured = statistics.mean(gather(mine))
            theory = ideal_bubble(schedule, v, p, m)
            rows.append((schedule, v, m, theory, measured))
            log(f"| {schedule} | {v} | {m} | {theory:.3f} | {measured:.3f} | {measured - theory:+.3f} | "
                f"{measured / theory:.2f} |")
    return rows


def bench_memory(comm, p, args):
    log(f"\n## activation memory: {p} stages, MLP width {args.width}, {args.depth} layers, "
        f"micro-batch {args.batch} rows")
    names = [n for n, _, _ in SCHEDULE_TABLE if not args.schedules or n in args.schedules or n == "1f1b"]
    log("| m | rank | " + " | ".join(f"{n} (MiB)" for n in names) + " | " +
        " | ".join(f"{n} / 1f1b" for n in names if n != "1f1b") + " |")
    log("| ---: | ---: | " + " | ".join("---:" for _ in names) + " | " +
        " | ".join("---:" for n in names if n != "1f1b") + " |")
    for m in (8, 16):
        peaks = {}
        for name in names:
            v = dict((n, vv) for n, vv, _ in SCHEDULE_TABLE)[name]
            pipe = Pipeline.from_layers(mlp_layers(args.width, args.depth), comm, num_microbatches=m, schedule=name,
                                        virtual_stages=None if v == 1 else v, loss_fn=nn.functional.mse_loss,
                                        track_memory=True)
            x = torch.randn(args.batch * m, args.width)
            pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
            peaks[name] = pipe.stats()["peak_activation_bytes"]
        per_rank = gather([peaks[n] for n in names])
        for r, row in enumerate(per_rank):
            base = row[names.index("1f1b")]
            log(f"| {m} | {r} | " + " | ".join(f"{b / 2**20:.1f}" for b in row) + " | " +
                " | ".join(f"{b / base:.2f}" for n, b in zip(names, row) if n != "1f1b") + " |")
        worst = [max(row[i] for row in per_rank) for i in range(len(names))]
        base = worst[names.index("1f1b")]
        log(f"| {m} | max | " + " | ".join(f"{b / 2**20:.1f}" for b in worst) + " | " +
            " | ".join(f"{b / base:.2f}" for n, b in zip(names, worst) if n != "1f1b") + " |")


def bench_throughput(comm, p, args):
    import torch.distributed.pipelining as tpp

    m = args.microbatches
    log(f"\n## throughput: {p} stages, MLP width {args.width}, {args.depth} layers, batch {args.batch * m} "
        f"in {m} micro-batches, {args.steps} steps x {args.rounds} rounds")
    log("| schedule | torch.distributed.pipelining (ms/step) | pycomm (ms/step) | speed-up | pycomm bubble | #wrong |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch * m, args.width, generator=gen)
    y = torch.randn(args.batch * m, args.width, generator=gen)
    results = []
    for name, v, torch_name in SCHEDULE_TABLE:
        if torch_name is None or (args.schedules and name not in args.schedules):
            continue
        fn = get_schedule(name, None if v == 1 else v)
        mine = stages_of(fn, p, comm.rank)
        total = p * v
        pipe = Pipeline.from_layers(mlp_layers(args.width, args.depth), comm, num_microbatches=m, schedule=fn,
                                    loss_fn=nn.functional.mse_loss)
        ours = pipe.module
        theirs_mods = [stage_layers(mlp_layers(args.width, args.depth), s, total) for s in mine]
        stages = [tpp.PipelineStage(mod, s, total, torch.device("cpu")) for s, mod in zip(mine, theirs_mods)]
        cls = getattr(tpp, torch_name)
        sched = cls(stages[0] if v == 1 else stages, m, loss_fn=nn.functional.mse_loss)
        first, last = pipe.is_first, pipe.is_last

        def run_ours():
            ours.zero_grad()
            return pipe.step(x if first else None, y if last else None)

        def run_theirs():
            for mod in theirs_mods:
                mod.zero_grad()
            losses = []
            kwargs = {}
            if last:
                kwargs = {"target": y, "losses": losses}
            if first:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            return torch.stack(losses).mean() if last else None

        # Correctness: both runners give the same first loss and gradients.
        a, b = run_ours(), run_theirs()
        wrong = 0
        if last and abs(a.item() - b.item()) > 1e-5 * max(1.0, abs(b.item())):
            wrong += 1
        theirs_params = [q for mod in theirs_mods for q in mod.parameters()]
        for pa, pb in zip(ours.parameters(), theirs_params):
            if not torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6):
                wrong += 1
        t_ours, t_theirs = [], []
        for _ in range(args.rounds):
            for fn_run, acc in ((run_theirs, t_theirs), (run_ours, t_ours)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn_run()
                dist.barrier()
                acc.append((time.perf_counter() - t0) / args.steps)
        ours_ms, theirs_ms = statistics.median(t_ours) * 1e3, statistics.median(t_theirs) * 1e3
        wrong = sum(gather(wrong))
        bubble = statistics.mean(gather(pipe.stats()["bubble"]))
        results.append((name, theirs_ms, ours_ms, wrong))
        log(f"| {name} ({torch_name}) | {theirs_ms:.1f} | {ours_ms:.1f} | {theirs_ms / ours_ms:.2f}x | {bubble:.3f} | "
            f"{wrong} |")
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
            buf.fill_(float("nan"))
            for _ in range(5):  # warm-up (first touch of the buffers, the lane's setup), then check
                fn()
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
                    if not idle:
                        # One round trip untimed: the ranks leave a barrier up to tens of us
                        # apart, which the first timed round trip would otherwise carry.
                        fn()
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
    ap.add_argument("--schedules", nargs="*", default=[], help="bubble, memory, throughput: only these schedules")
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
