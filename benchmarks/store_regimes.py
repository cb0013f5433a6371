"""The host's two regimes and the mailbox store modes, side by side in one run.

On a VM the speed at which one vCPU reads lines another has just written
changes for seconds at a time (the host moves the vCPUs). This runs 2 ranks
for --seconds, and in every round times, back to back on the same buffers:
DeepSpeed's shared-memory all-reduce (``--deepspeed``, optional), and pycomm's
all-reduce on three communicators that write their mailboxes cached,
streaming, and auto (the tuner, the default) — see
csrc/transport/store_tuner.h. Every round is classed slow when the cached
communicator ran below 55 % of its median, normal otherwise; the table gives
each variant's median algbw per class and size. Every result is checked
against the Gloo all-reduce of the same data::

    python benchmarks/store_regimes.py --seconds 300 --sizes 256K,1M,16M --deepspeed
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pycomm.bench.cli import parse_size
from pycomm.bench.report import format_size

POLICIES = ("cached", "streaming", "auto")


def _median_time(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import pycomm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.deepspeed:
        from pycomm.bench.deepspeed_shm import load

        load()  # before the group exists (see load)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
    ds = None
    if args.deepspeed:
        from pycomm.bench.deepspeed_shm import setup

        ds = setup(world)
    comms = {}
    for policy in POLICIES:
        os.environ["PYCOMM_SHM_STORES"] = policy
        comms[policy] = pycomm.Communicator(store=store, rank=rank, world_size=world, name=policy, timeout=60)
    os.environ.pop("PYCOMM_SHM_STORES")
    data = {n: torch.randn(n // 4, generator=torch.Generator().manual_seed(n + rank)) for n in args.sizes}
    expected = {}
    for n, x in data.items():
        expected[n] = x.clone()
        dist.all_reduce(expected[n])
    rounds: List[Dict[Tuple[str, int], float]] = []
    wrong = 0
    start = time.time()
    while time.time() - start < args.seconds:
        row = {}
        for n in args.sizes:
            t = torch.empty(n // 4)
            calls = {p: (lambda c=c: c.all_reduce(t)) for p, c in comms.items()}
            if ds is not None:
                calls["deepspeed"] = lambda: ds(t)
            for name, fn in calls.items():
                dist.barrier()
                seconds = torch.tensor([_median_time(fn, max(4, (32 << 20) // n))], dtype=torch.float64)
                dist.all_reduce(seconds, dist.ReduceOp.MAX)
                row[(name, n)] = n / seconds.item() / 1e9
                if name in comms:
                    t.copy_(data[n])
                    fn()
                    wrong += int((t != expected[n]).sum())
        rounds.append(row)
    total = torch.tensor([wrong])
    dist.all_reduce(total)
    if rank == 0:
        q.put((rounds, int(total)))
    for c in comms.values():
        c.close()
    # Before the interpreter's exit: a group it tears down may abort the process.
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--sizes", default="256K,1M,16M")
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's shared-memory all-reduce")
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    rounds, wrong = q.get(timeout=args.seconds + 600)
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    names = list(POLICIES) + (["deepspeed"] if args.deepspeed else [])
    print(f"| size | regime | rounds | {' | '.join(names)} (algbw GB/s, median) |")
    print("| ---: | --- | ---: |" + " ---: |" * len(names))
    for n in args.sizes:
        typical = statistics.median(r[("cached", n)] for r in rounds)
        for regime in ("normal", "slow"):
            rs = [r for r in rounds if (r[("cached", n)] < 0.55 * typical) == (regime == "slow")]
            if rs:
                cells = " | ".join(f"{statistics.median(r[(m, n)] for r in rs):.2f}" for m in names)
                print(f"| {format_size(n)} | {regime} | {len(rs)} | {cells} |")
    print(f"#wrong: {wrong}")
    if failed:
        print(f"ranks {failed} exited with codes {[procs[r].exitcode for r in failed]}", file=sys.stderr)
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    sys.exit(main())
