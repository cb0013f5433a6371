"""CUDA-event timing shared by the GPU benchmarks."""
import statistics
from typing import Callable, Optional

import torch


def event_median_ms(fn: Callable[[], object], repeats: int, before: Optional[Callable[[], object]] = None) -> float:
    """Median milliseconds of ``fn`` between CUDA events, after 3 warm-up calls (``before`` runs once, after
    the warm-up: a barrier, say)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if before is not None:
        before()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
