"""Latency of pycomm.GroupCommunicator's compressed all-reduce between hosts.

Run on the simulated hosts (needs root)::

    python benchmarks/multihost/testbed.py --hosts 4 --rate 1gbit -- \\
        benchmarks/multihost/group_latency.py [--sizes 1024,65536,610000,4194304] [--iters 30]

Per size and codec (int4 in blocks of 64, top-k 1 %), the median and the
fastest of ``--iters`` calls, each started together on every rank (a
barrier before it), float32 inputs drawn afresh; every rank checks that the
ranks got the same bits (#differ).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import pycomm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1024,65536,610000,4194304")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gc = pycomm.GroupCommunicator()
    if rank == 0:
        print(f"# GroupCommunicator, {world} ranks, float32 avg, {args.iters} calls per point")
        print(f"{'elements':>10} {'codec':>9} | {'median ms':>9} {'min ms':>8} {'#differ':>7}")
    for n in (int(v) for v in args.sizes.split(",")):
        for name, codec in (("int4-b64", pycomm.Int4(block=64)), ("topk-1%", pycomm.TopK(0.01))):
            for _ in range(5):
                gc.all_reduce(torch.randn(n), op="avg", compression=codec)
            times = []
            for _ in range(args.iters):
                y = torch.randn(n)
                dist.barrier()
                t = time.perf_counter()
                gc.all_reduce(y, op="avg", compression=codec)
                times.append(time.perf_counter() - t)
            first = y.clone()
            dist.broadcast(first, 0)
            differ = torch.tensor([int((first.view(torch.int32) != y.view(torch.int32)).sum())])
            dist.all_reduce(differ)
            if rank == 0:
                print(f"{n:>10} {name:>9} | {statistics.median(times) * 1e3:9.2f} {min(times) * 1e3:8.2f} "
                      f"{int(differ):>7}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
