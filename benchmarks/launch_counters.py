"""What differs between a slow and a fast launch: per-call software counters.

Runs K fresh launches of 2 ranks; in each, every rank times N all-reduces of
--size bytes (ordinary and registered buffers, alternating blocks) and reads,
around the timed calls, the counters ``perf stat`` reports as software events
(context switches, voluntary and not; minor page faults) from getrusage, and
the CPU its thread ran on (sampled after every call: migrations, and whether
the two ranks shared a CPU). Hardware counters (cache misses) are not exposed
to this VM's guests (``perf stat -e cache-misses``: not supported).
Prints one row per launch and rank::

    python benchmarks/launch_counters.py --launches 8 --size 16M
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pycomm.bench.cli import parse_size  # noqa: E402


def _rank(rank: int, world: int, port: int, size: int, iters: int, q) -> None:
    import pycomm

    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name="counters", timeout=60)
    n = size // 4
    bufs = {"plain": torch.randn(n), "registered": comm.empty(n)}
    bufs["registered"].copy_(bufs["plain"])
    out = {}
    for label, t in bufs.items():
        for _ in range(3):
            comm.all_reduce(t, op="avg")
        comm.barrier()
        cpus = []
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            comm.all_reduce(t, op="avg")
            samples.append(time.perf_counter() - t0)
            cpus.append(sched_getcpu())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out[label] = dict(
            gbps=size / statistics.median(samples) / 1e9,
            vcsw=(r1.ru_nvcsw - r0.ru_nvcsw) / iters, ivcsw=(r1.ru_nivcsw - r0.ru_nivcsw) / iters,
            minflt=(r1.ru_minflt - r0.ru_minflt) / iters,
            migrations=sum(a != b for a, b in zip(cpus, cpus[1:])), cpus=cpus)
    q.put((rank, out))
    comm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--size", type=parse_size, default=parse_size("16M"))
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    print("| launch | buffer | rank | algbw GB/s | vol. ctx sw / call | invol. ctx sw / call | minor faults / call "
          "| migrations | calls with both ranks on one CPU |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ctx = mp.get_context("spawn")
    for launch in range(args.launches):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, args.size, args.iters, q)) for r in range(2)]
        for p in procs:
            p.start()
        res = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join()
        for label in ("plain", "registered"):
            shared = sum(a == b for a, b in zip(res[0][label]["cpus"], res[1][label]["cpus"]))
            for r in (0, 1):
                o = res[r][label]
                print(f"| {launch + 1} | {label} | {r} | {o['gbps']:.2f} | {o['vcsw']:.2f} | {o['ivcsw']:.2f} | "
                      f"{o['minflt']:.2f} | {o['migrations']} | {shared} of {args.iters} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
