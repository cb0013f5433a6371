"""DDP comm-hook benchmarks: compute–communication overlap, and end-to-end
training with each hook. Run under torchrun, on one host or on the simulated
multi-host testbed (one torchrun node per host)::

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_hooks.py overlap
    python benchmarks/multihost/testbed.py --hosts 2 --nproc-per-host 1 -- benchmarks/ddp_hooks.py overlap
    python benchmarks/multihost/testbed.py --hosts 4 --nproc-per-host 1 --rate 1gbit -- \\
        benchmarks/ddp_hooks.py e2e

overlap: an MLP whose backward and communication take comparable time.
For DDP on gloo (no hook), pycomm's allreduce_hook and pycomm's stale_hook
(staleness 1: a step's buckets travel behind the next step) it reports
  compute  forward + backward with a hook that returns at once (no traffic),
  comm     the same buckets all-reduced back to back with no compute,
  step     forward + backward with the real communication,
  overlap efficiency = (compute + comm - step) / min(compute, comm)
(1: communication entirely hidden; 0: none of it). Each is timed in blocks
of --block consecutive steps (the blocks in rotation); a stale block's first
step (nothing in flight yet) is not counted, and its last averages are
drained between blocks.

straggler: 4 ranks train digits for --steps global steps, each step a real
forward + backward plus a simulated compute of --compute-ms (a sleep, so the
ranks do not fight for this machine's cores), and rank 3 is 50 % slower per
step (pycomm.Straggler). Synchronous DDP (gloo), synchronous pycomm
(allreduce_hook) and pycomm.DeadlineAverager (a deadline, and backup
workers) side by side: time per global step and held-out accuracy.

e2e: a ~25M-parameter MLP trained for a fixed number of steps with DDP's
default (gloo), PyTorch's bf16_compress_hook (and powerSGD_hook, rank 4:
``torch-powersgd``), pycomm's powersgd_hook (rank 4: ``powersgd``,
``powersgd-1b`` with one bucket as torch's, ``powersgd-int8`` with int8
factors), and pycomm's allreduce_hook, int8_hook and
topk_hook (1 %), each compressed hook also through the device-generic group
path (``int8-group``, ``topk-group``), allreduce_hook with registered bucket
copies (``allreduce-reg``), and staleness 1 with int8 on the
wire (``stale1-int8``): median step time (forward, backward,
optimizer) and the final loss, every config on the same data. "none" (a hook
that sends nothing; each rank trains alone) gives the compute floor.
Medians over the measured steps; ratios are side by side in one run.

summarize: e2e rows of several fresh launches (each run's --json file, named
``..._<rate>_...``), per rate: step time min / median / max per config and
the median of the launches' speed-ups over torch's bf16 hook::

    python benchmarks/ddp_hooks.py summarize gpu-logs/nccl_ddp_*.json
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm import hooks


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def mlp(sizes, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def noop_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def torch_bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's bf16_compress_hook, unchanged. DDP refuses it by name
    without CUDA (a check for NCCL's bfloat16 support); Gloo reduces bfloat16
    on CPU, so on CPU it is called through this wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def bucket_sizes(model, kw, x):
    """Bucket sizes (elements) of one backward, in the order DDP issues them
    (after its bucket rebuild)."""
    sizes = []

    def spy(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if state["record"]:
            sizes.append(bucket.buffer().numel())
        return noop_hook(None, bucket)

    state = {"record": False}
    m = DDP(model, **kw)
    m.register_comm_hook(state, spy)
    for i in range(3):
        state["record"] = i == 2
        m(x).square().mean().backward()
    return sizes


def timed_together(fns, steps, warmup, block=1, skip=None, settle=None):
    """Medians of each of ``fns`` (seconds), run in rotation so that load
    changes on a shared machine hit them alike; the slowest rank's figure.
    Each turn runs a function ``block`` times in a row (each timed); the
    first ``skip[j]`` of a block are not counted, and ``settle[j]`` (untimed)
    runs after the block."""
    out = [[] for _ in fns]
    for i in range(warmup + steps):
        for j, fn in enumerate(fns):
            for b in range(block):
                dist.barrier()
                t = time.perf_counter()
                fn()
                if i >= warmup and b >= (skip[j] if skip else 0):
                    out[j].append(time.perf_counter() - t)
            if settle and settle[j]:
                settle[j]()
    t = torch.tensor([statistics.median(o) for o in out], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def overlap(args):
    sizes = [args.width] * (args.layers + 1)
    x = torch.randn(args.batch, args.width)
    layer_mb = args.width * args.width * 4 / 2**20
    # Below one layer: every weight is a bucket of its own (DDP never splits
    # a parameter), so all but the last bucket can hide behind backward.
    kw = dict(bucket_cap_mb=layer_mb * 0.5)
    comm = pycomm.get_default()
    buckets = bucket_sizes(mlp(sizes), kw, x)
    log(f"# overlap: {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, "
        f"{sum(buckets) * 4 / 2**20:.1f} MiB of gradients in {len(buckets)} buckets, "
        f"{dist.get_world_size()} ranks, transport {comm.transport}")
    rows = []
    for name in args.configs.split(","):
        model = DDP(mlp(sizes), **kw)
        compute_model = DDP(mlp(sizes), **kw)
        compute_model.register_comm_hook(None, noop_hook)
        stale = None
        if name == "pycomm":
            model.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
        elif name == "stale1":
            stale = hooks.StaleState(staleness=1)
            model.register_comm_hook(stale, hooks.stale_hook)
        elif name != "gloo":
            raise SystemExit(f"unknown overlap config {name}")
        bufs = [torch.randn(n) for n in buckets]

        def comm_only():
            if name in ("pycomm", "stale1"):
                works = [comm.all_reduce(b, op="avg", async_op=True) for b in bufs]
            else:
                works = [dist.all_reduce(b, async_op=True) for b in bufs]
            for w in works:
                w.wait()

        def step(m):
            def run():
                m.zero_grad(set_to_none=False)
                m(x).square().mean().backward()
            return run

        def drain():  # the averages still in flight (not applied: no optimizer here)
            for _ in stale.flush():
                pass

        t_compute, t_comm, t_step = timed_together(
            [step(compute_model), comm_only, step(model)], args.steps, args.warmup, block=args.block,
            skip=[0, 0, 1 if stale else 0], settle=[None, None, drain if stale else None])
        eff = (t_compute + t_comm - t_step) / min(t_compute, t_comm)
        rows.append(dict(config=name, compute_ms=t_compute * 1e3, comm_ms=t_comm * 1e3, step_ms=t_step * 1e3,
                         efficiency=eff))
        log(f"{name:>8} | compute {t_compute * 1e3:8.1f} ms | comm {t_comm * 1e3:8.1f} ms | "
            f"step {t_step * 1e3:8.1f} ms | overlap efficiency {eff:5.2f}")
    return rows


def e2e(args):
    sizes = [args.width_in, args.hidden, args.hidden, args.width_in]
    world, rank = dist.get_world_size(), dist.get_rank()
    params = sum(p.numel() for p in mlp(sizes).parameters())
    dev = torch.device(args.device)
    # CUDA models: the hooks' states over the process group (its policy picks
    # each bucket's path); CPU ones share pycomm's default communicator.
    comm = pycomm.get_default() if dev.type == "cpu" else None
    on = dict(communicator=comm) if comm is not None else {}
    log(f"# e2e: MLP {sizes}, {params / 1e6:.1f}M parameters, batch {args.batch} per rank, {world} ranks, "
        f"{args.steps} steps ({args.warmup} not timed), SGD lr {args.lr}, "
        + (f"transport {comm.transport}" if comm is not None else f"{dev} over {args.backend}"))
    teacher = mlp([args.width_in, 256, args.width_in], seed=123).to(dev)
    rows = []
    for name in args.configs.split(","):
        # gradient_as_bucket_view: no copy between gradients and buckets, as
        # performance-minded users run DDP (the same for every config).
        # PowerSGD issues a bucket's second all-reduce from the first one's
        # callback thread; over Gloo that races with the next bucket's first
        # all-reduce (ranks issue them in different orders: a size mismatch),
        # so it gets one bucket.
        # pycomm's PowerSGD issues every collective from the hook's thread: any
        # buckets ("powersgd-1b": one bucket too, for a like-for-like row).
        one_bucket = dict(bucket_cap_mb=1 << 16) if name in ("torch-powersgd", "powersgd-1b") else {}
        model = DDP(mlp(sizes, seed=1).to(dev), gradient_as_bucket_view=True, **one_bucket)
        state = None
        if name == "none":  # no communication at all: the compute floor
            model.register_comm_hook(None, noop_hook)
        elif name == "torch-bf16":
            model.register_comm_hook(None, torch_bf16_hook)
        elif name == "torch-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            model.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                        start_powerSGD_iter=args.start_iter), psgd.powerSGD_hook)
        elif name in ("powersgd", "powersgd-1b", "powersgd-int8"):  # rank 4, as torch-powersgd
            state = hooks.PowerSGDState(rank=4, start_iter=args.start_iter, **on,
                                        wire=pycomm.Int8() if name == "powersgd-int8" else None)
            model.register_comm_hook(state, hooks.powersgd_hook)
        elif name == "stale1-int8":
            state = hooks.StaleState(staleness=1, wire=pycomm.Int8(), **on)
            model.register_comm_hook(state, hooks.stale_hook)
        elif name in ("allreduce", "allreduce-reg"):  # -reg: bucket copies in registered memory
            state = hooks.AllReduceState(registered=name == "allreduce-reg", **on)
            model.register_comm_hook(state, hooks.allreduce_hook)
        elif name in ("int8", "int8-group"):  # -group: the device-generic path over a Gloo group
            where = on if name == "int8" else dict(path="group")
            state = hooks.CompressionState(codec=pycomm.Int8(), start_iter=args.start_iter, **where)
            model.register_comm_hook(state, hooks.int8_hook)
        elif name in ("topk", "topk-group"):
            where = on if name == "topk" else dict(path="group")
            state = hooks.CompressionState(codec=pycomm.TopK(0.01), start_iter=args.start_iter, **where)
            model.register_comm_hook(state, hooks.topk_hook)
        elif name != "gloo":
            raise SystemExit(f"unknown config {name}")
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 + rank)
        times, losses = [], []
        for i in range(args.steps):
            x = torch.randn(args.batch, args.width_in, generator=gen).to(dev)
            with torch.no_grad():
                y = teacher(x)
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if i >= args.warmup:
                times.append(dt)
            losses.append(loss.item())
        if isinstance(state, hooks.StaleState):
            for _ in state.flush():  # the last average, so every config applies every step's gradients
                opt.step()
        t = torch.tensor([statistics.median(times), sum(losses[-5:]) / 5], dtype=torch.float64)
        dist.all_reduce(t)
        step_s, loss = t[0].item() / world, t[1].item() / world
        row = dict(config=name, step_ms=step_s * 1e3, final_loss=loss, first_loss=losses[0])
        if state is not None:
            row.update({k: v for k, v in state.stats().items() if k in ("compression_ratio", "comm_seconds")})
        rows.append(row)
        log(f"{name:>10} | step {step_s * 1e3:8.1f} ms | loss {losses[0]:.4f} -> {loss:.4f}"
            + (f" | compression {row['compression_ratio']:.1f}x" if "compression_ratio" in row else ""))
        del model, opt
    base = next((r for r in rows if r["config"] == "torch-bf16"), None)
    if base:
        log("speed-up over torch bf16_compress_hook: " + ", ".join(
            f"{r['config']} {base['step_ms'] / r['step_ms']:.2f}x" for r in rows))
    return rows


def straggler(args):
    """Synchronous averaging against the deadline average with one slow rank."""
    from sklearn.datasets import load_digits

    world, rank = dist.get_world_size(), dist.get_rank()
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    xte, yte, xtr, ytr = x[:450], y[:450], x[450:], y[450:]
    slow = pycomm.Straggler(world - 1, slowdown=args.slowdown)
    log(f"# straggler: digits MLP, {world} ranks, {args.steps} global steps of a {64 // world}-sample batch per "
        f"rank + {args.compute_ms} ms simulated compute; rank {world - 1} {args.slowdown:.0%} slower per step; "
        f"deadline {args.deadline_ms} ms")
    rows = []
    for name in args.configs.split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                    torch.nn.ReLU(), torch.nn.Linear(128, 10))
        net = model
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
        if name in ("gloo", "pycomm"):
            net = DDP(model)
            if name == "pycomm":
                net.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
            stepper = opt
        elif name in ("deadline", "backup"):
            stepper = pycomm.DeadlineAverager(
                opt, deadline=args.deadline_ms / 1e3 if name == "deadline" else None,
                backups=1 if name == "backup" else None, total_steps=args.steps, lr_scheduler=sched)
        else:
            raise SystemExit(f"unknown straggler config {name}")
        gen = torch.Generator().manual_seed(7 + rank)
        per_rank = 64 // world
        dist.barrier()
        t0 = time.perf_counter()
        call = 0
        while (stepper.step_count if stepper is not opt else call) < args.steps:
            with slow.step(call, rank, world):
                time.sleep(args.compute_ms / 1e3)
                idx = torch.randint(0, len(xtr), (per_rank,), generator=gen)
                stepper.zero_grad()
                torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            stepper.step()
            if stepper is opt:
                sched.step()
            call += 1
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
        t = torch.tensor([elapsed, call], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row = dict(config=name, step_ms=t[0].item() / args.steps * 1e3, accuracy=acc, calls_max=int(t[1].item()))
        if stepper is not opt:
            contributors = stepper.stats()["contributors"]
            row["mean_contributors"] = sum(map(len, contributors)) / len(contributors)
            row["slow_rank_calls"] = call if rank == world - 1 else None
            stepper.close()
        rows.append(row)
        log(f"{name:>9} | {row['step_ms']:7.1f} ms per global step | accuracy {acc:5.2f} %"
            + (f" | {row['mean_contributors']:.2f} contributors per step" if "mean_contributors" in row else ""))
        dist.barrier()
    sync = min((r["step_ms"] for r in rows if r["config"] in ("gloo", "pycomm")), default=None)
    if sync:
        log("speed-up over the faster synchronous config: " + ", ".join(
            f"{r['config']} {sync / r['step_ms']:.2f}x" for r in rows))
    return rows


def summarize(paths: List[str]) -> str:
    """The e2e rows of several fresh launches (their --json files), per link
    rate when the files say one (``..._1gbit_...``): step time min / median /
    max per config, and the median of each launch's speed-up over torch's
    bf16 hook, measured within that launch."""
    groups: Dict[str, List[dict]] = {}
    for path in paths:
        rate = next((part for part in os.path.basename(path).split("_") if part.endswith("bit")), "")
        with open(path) as f:
            groups.setdefault(rate, []).append(json.load(f))
    lines = []
    for rate, runs in sorted(groups.items()):
        lines.append(f"### {rate or 'e2e'}: {len(runs)} launches")
        lines.append("| config | step ms, min / median / max | x torch bf16 (median of launches) | final loss |")
        lines.append("| --- | --- | ---: | ---: |")
        configs = list(dict.fromkeys(r["config"] for run in runs for r in run["rows"]))
        for name in configs:
            steps, ups, losses = [], [], []
            for run in runs:
                by = {r["config"]: r for r in run["rows"]}
                if name not in by:
                    continue
                steps.append(by[name]["step_ms"])
                losses.append(by[name]["final_loss"])
                if "torch-bf16" in by:
                    ups.append(by["torch-bf16"]["step_ms"] / by[name]["step_ms"])
            up = f"{statistics.median(ups):.2f}x" if ups else "-"
            lines.append(f"| {name} | {min(steps):.1f} / {statistics.median(steps):.1f} / {max(steps):.1f} | {up} | "
                         f"{statistics.median(losses):.4f} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summarize"]:
        print(summarize(argv[1:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["overlap", "e2e", "straggler"])
    p.add_argument("--configs", default=None, help="comma-separated (overlap: gloo,pycomm,stale1; "
                   "e2e: none,gloo,torch-bf16,allreduce,int8,topk; also int8-group, topk-group (the "
                   "device-generic path forced), torch-powersgd, stale1-int8; none: no communication; "
                   "straggler: gloo,pycomm,deadline,backup)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--width", type=int, default=1024, help="overlap: layer width")
    p.add_argument("--layers", type=int, default=8, help="overlap: layers")
    p.add_argument("--width-in", type=int, default=1024, help="e2e: input/output width")
    p.add_argument("--hidden", type=int, default=4096, help="e2e: hidden width (4096: 25.2M parameters)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--start-iter", type=int, default=2, help="e2e: uncompressed iterations of int8/topk")
    p.add_argument("--block", type=int, default=4, help="overlap: consecutive steps per turn")
    p.add_argument("--compute-ms", type=float, default=100.0, help="straggler: simulated compute per step")
    p.add_argument("--slowdown", type=float, default=0.5, help="straggler: how much slower the last rank is")
    p.add_argument("--deadline-ms", type=float, default=2.0, help="straggler: the deadline config's deadline")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--device", default="cpu", help="e2e: cpu, or cuda (every rank on GPU 0 of its host)")
    p.add_argument("--backend", default="gloo", help="the default group's backend (e.g. cpu:gloo,cuda:nccl)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(args.backend)
    if args.mode == "overlap":
        args.configs = args.configs or "gloo,pycomm,stale1"
        args.steps = args.steps or 10
        args.batch = args.batch or 64
        rows = overlap(args)
    elif args.mode == "straggler":
        args.configs = args.configs or "gloo,pycomm,deadline,backup"
        args.steps = args.steps or 100
        rows = straggler(args)
    else:
        args.configs = args.configs or "none,gloo,torch-bf16,allreduce,int8,topk"
        args.steps = args.steps or 25
        args.batch = args.batch or 16
        rows = e2e(args)
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "args": vars(args), "rows": rows}, f, indent=2)
    pycomm.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
