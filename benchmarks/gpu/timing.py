"""CUDA-event timing shared by the GPU benchmarks."""
import statistics
from typing import Callable, Optional

import torch
import torch.distributed as dist


def batch_median_ms(fn: Callable[[], object], iters: int, runs: int, before: Optional[Callable[[], object]] = None,
                    graph: bool = False) -> float:
    """Milliseconds per call, nccl-tests' way: ``iters`` calls issued back to back between two CUDA events, so
    the host's cost per call hides behind the device's wherever it is the smaller; the median of ``runs`` such
    batches, after 3 warm-up calls (``before`` runs once, after the warm-up: a barrier, say). With ``graph``,
    the ``iters`` calls are captured once in a CUDA graph and each batch is one replay (nccl-tests' ``-G``):
    the device's time alone, no launch costs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        torch.cuda.synchronize()
    if before is not None:
        before()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if g is not None:
            g.replay()
        else:
            for _ in range(iters):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def event_median_ms(fn: Callable[[], object], repeats: int, before: Optional[Callable[[], object]] = None) -> float:
    """Median milliseconds of one call of ``fn`` between CUDA events, each waited for before the next."""
    return batch_median_ms(fn, 1, repeats, before)


def slowest(seconds: float) -> float:
    """The slowest rank's figure (a CPU tensor: every group in the benchmarks has Gloo for those)."""
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
