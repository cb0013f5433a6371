"""DDP comm-hook benchmarks: compute–communication overlap, and end-to-end
training with each hook. Run under torchrun, on one host or on the simulated
multi-host testbed (one torchrun node per host)::

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_hooks.py overlap
    python benchmarks/multihost/testbed.py --hosts 2 --nproc-per-host 1 -- benchmarks/ddp_hooks.py overlap
    python benchmarks/multihost/testbed.py --hosts 4 --nproc-per-host 1 --rate 1gbit -- \\
        benchmarks/ddp_hooks.py e2e

overlap: an MLP whose backward and communication take comparable time.
For DDP on gloo (no hook) and for pycomm's allreduce_hook it reports
  compute  forward + backward with a hook that returns at once (no traffic),
  comm     the same buckets all-reduced back to back with no compute,
  step     forward + backward with the real communication,
  overlap efficiency = (compute + comm - step) / min(compute, comm)
(1: communication entirely hidden; 0: none of it).

e2e: a ~25M-parameter MLP trained for a fixed number of steps with DDP's
default (gloo), PyTorch's bf16_compress_hook, and pycomm's allreduce_hook, int8_hook and
topk_hook (1 %), each compressed hook also through the device-generic group
path (``int8-group``, ``topk-group``): median step time (forward, backward,
optimizer) and the final loss, every config on the same data. "none" (a hook
that sends nothing; each rank trains alone) gives the compute floor.
Medians over the measured steps; ratios are side by side in one run.
"""
import argparse
import json
import os
import statistics
import sys
import time

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


def timed_together(fns, steps, warmup):
    """Medians of each of ``fns`` (seconds), run in rotation so that load
    changes on a shared machine hit them alike; the slowest rank's figure."""
    out = [[] for _ in fns]
    for i in range(warmup + steps):
        for j, fn in enumerate(fns):
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i >= warmup:
                out[j].append(time.perf_counter() - t)
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
        if name == "pycomm":
            model.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
        bufs = [torch.randn(n) for n in buckets]

        def comm_only():
            if name == "pycomm":
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

        t_compute, t_comm, t_step = timed_together([step(compute_model), comm_only, step(model)], args.steps,
                                                   args.warmup)
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
    comm = pycomm.get_default()
    log(f"# e2e: MLP {sizes}, {params / 1e6:.1f}M parameters, batch {args.batch} per rank, {world} ranks, "
        f"{args.steps} steps ({args.warmup} not timed), SGD lr {args.lr}, transport {comm.transport}")
    teacher = mlp([args.width_in, 256, args.width_in], seed=123)
    rows = []
    for name in args.configs.split(","):
        # gradient_as_bucket_view: no copy between gradients and buckets, as
        # performance-minded users run DDP (the same for every config).
        model = DDP(mlp(sizes, seed=1), gradient_as_bucket_view=True)
        state = None
        if name == "none":  # no communication at all: the compute floor
            model.register_comm_hook(None, noop_hook)
        elif name == "torch-bf16":
            model.register_comm_hook(None, torch_bf16_hook)
        elif name == "allreduce":
            state = hooks.AllReduceState(communicator=comm)
            model.register_comm_hook(state, hooks.allreduce_hook)
        elif name in ("int8", "int8-group"):  # -group: the device-generic path over a Gloo group
            where = dict(communicator=comm) if name == "int8" else dict(path="group")
            state = hooks.CompressionState(codec=pycomm.Int8(), start_iter=args.start_iter, **where)
            model.register_comm_hook(state, hooks.int8_hook)
        elif name in ("topk", "topk-group"):
            where = dict(communicator=comm) if name == "topk" else dict(path="group")
            state = hooks.CompressionState(codec=pycomm.TopK(0.01), start_iter=args.start_iter, **where)
            model.register_comm_hook(state, hooks.topk_hook)
        elif name != "gloo":
            raise SystemExit(f"unknown config {name}")
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 + rank)
        times, losses = [], []
        for i in range(args.steps):
            x = torch.randn(args.batch, args.width_in, generator=gen)
            with torch.no_grad():
                y = teacher(x)
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t
            if i >= args.warmup:
                times.append(dt)
            losses.append(loss.item())
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["overlap", "e2e"])
    p.add_argument("--configs", default=None, help="comma-separated (overlap: gloo,pycomm; "
                   "e2e: none,gloo,torch-bf16,allreduce,int8,topk; also int8-group, topk-group (the "
                   "device-generic path forced); none: no communication)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--width", type=int, default=1024, help="overlap: layer width")
    p.add_argument("--layers", type=int, default=8, help="overlap: layers")
    p.add_argument("--width-in", type=int, default=1024, help="e2e: input/output width")
    p.add_argument("--hidden", type=int, default=4096, help="e2e: hidden width (4096: 25.2M parameters)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--start-iter", type=int, default=2, help="e2e: uncompressed iterations of int8/topk")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if args.mode == "overlap":
        args.configs = args.configs or "gloo,pycomm"
        args.steps = args.steps or 10
        args.batch = args.batch or 64
        rows = overlap(args)
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
