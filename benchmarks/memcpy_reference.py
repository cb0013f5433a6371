"""Single-core copy bandwidth: the yardstick for shared-memory collectives.

An all-reduce over shared memory must at least read its input and write its
output once per rank, so one core's copy bandwidth bounds what it can reach.

    python benchmarks/memcpy_reference.py            # 64 MiB and 1 MiB buffers
"""
import statistics
import sys
import time

import torch


def copy_bandwidth(nbytes: int, repeats: int = 15) -> float:
    a = torch.randn(nbytes // 4)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples) / 1e9


if __name__ == "__main__":
    torch.set_num_threads(1)
    sizes = [int(s) for s in sys.argv[1:]] or [64 << 20, 1 << 20]
    for n in sizes:
        print(f"single-core copy of {n >> 20} MiB: {copy_bandwidth(n):.2f} GB/s (median of 15)")
