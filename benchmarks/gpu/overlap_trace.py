"""Compute–communication overlap on streams, seen in a profiler trace: DDP on
CUDA (a 25M-parameter MLP, 2 ranks sharing GPU 0 over Gloo, so buckets take
the group path) with pycomm's int8_hook, 5 steps under torch.profiler on
rank 0. From the trace's kernels it reports:

* pycomm's kernels (quantize, dequantize, reduce, ...) as a share of the step;
* how much of their time overlaps other kernels (the backward) running on
  another stream at the same moment;
* the streams each kind of kernel ran on.

    python benchmarks/gpu/overlap_trace.py [--out DIR] [--hidden 4096] [--steps 5]

The trace goes to DIR/overlap_trace.json.gz (chrome://tracing, Perfetto).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
from typing import Dict, List, Tuple

# pycomm's CUDA kernels (csrc/kernels/cuda, csrc/transport): what the hooks
# add to a step.
PYCOMM_KERNELS = ("quantize_kernel", "quantize_warp_kernel", "dequantize_kernel", "dequantize_warp_kernel", "pycomm::",
                  "topk", "fold_kernel", "histogram_kernel", "choose_kernel", "gather_kernel", "scatter_kernel",
                  "orthogonalize_kernel", "ipc_all_reduce_kernel", "ipc_quantized_kernel", "schedule_kernel",
                  "barrier_kernel")


def is_pycomm(name: str) -> bool:
    return any(k in name for k in PYCOMM_KERNELS) and "at::native" not in name


def union_length(spans: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_with(spans: List[Tuple[float, float]], others: List[Tuple[float, float]]) -> float:
    """Time of `spans` (disjoint or not) during which some span of `others` runs."""
    merged: List[Tuple[float, float]] = []
    for a, b in sorted(others):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    total = 0.0
    for a, b in spans:
        for c, d in merged:
            if d <= a:
                continue
            if c >= b:
                break
            total += min(b, d) - max(a, c)
    return total


def analyse(trace: Dict, steps: int) -> Dict[str, object]:
    """The figures above from a chrome trace (kineto's export)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "no kernels in the trace"}
    ours = [e for e in kernels if is_pycomm(e["name"])]
    theirs = [e for e in kernels if not is_pycomm(e["name"])]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    ours_time = union_length([span(e) for e in ours])
    # Overlap counts only other kernels on another stream: two kernels of
    # one stream never run at once.
    streams = lambda es: sorted({e.get("args", {}).get("stream") for e in es})  # noqa: E731
    overlapped = 0.0
    for s in streams(ours):
        mine = [span(e) for e in ours if e.get("args", {}).get("stream") == s]
        others = [span(e) for e in theirs if e.get("args", {}).get("stream") != s]
        overlapped += overlap_with(mine, others)
    step_us = (end - start) / max(1, steps)
    return {"step_ms": step_us / 1e3, "pycomm_kernel_ms_per_step": ours_time / max(1, steps) / 1e3,
            "pycomm_share": ours_time / (end - start), "overlapped_share": overlapped / ours_time if ours_time else 0.0,
            "pycomm_streams": streams(ours), "other_streams": streams(theirs),
            "pycomm_kernels": sorted({e["name"].split("(")[0][:60] for e in ours})}


def worker(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm
    from pycomm import hooks

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    sizes = [1024, args.hidden, args.hidden, 1024]
    layers = []
    for i in range(3):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1])] + ([torch.nn.ReLU()] if i < 2 else [])
    model = DDP(torch.nn.Sequential(*layers).cuda(), gradient_as_bucket_view=True)
    state = hooks.CompressionState(codec=pycomm.Int8(), start_iter=0)
    model.register_comm_hook(state, hooks.int8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(args.batch, 1024, device="cuda"), torch.randn(args.batch, 1024, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        raw = os.path.join(args.out, "overlap_trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
        res = analyse(trace, args.steps)
        params = sum(p.numel() for p in model.parameters())
        print(f"# {torch.cuda.get_device_name()}: DDP, {params / 1e6:.1f}M parameters, int8_hook, {world} ranks "
              f"sharing the GPU, routes {state.routes()}")
        for k, v in res.items():
            print(f"{k}: {v}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-logs"))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    mp.spawn(worker, args=(args.world, 29500 + os.getpid() % 1000, args), nprocs=args.world)


if __name__ == "__main__":
    main()
