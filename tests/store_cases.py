"""Worker-side cases of how the shared-memory transport writes its mailboxes
(PYCOMM_SHM_STORES: cached, streaming, or auto, which measures both): the
mode must change no bit of any result."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from collective_cases import digest, make_input
from harness import make_comm

# Counts from below the tuner's smallest size class (4 KiB) through the
# small classes to several 1 MiB rounds, odd so that chunks end off cache
# lines.
COUNTS = [1021, 9001, 70001, 300007]
CASES = [("all_reduce", algo, dtype, op) for algo in ("ring", "tree", "direct", "auto")
         for dtype, op in ((torch.float32, "sum"), (torch.float32, "avg"), (torch.float32, "max"),
                           (torch.bfloat16, "sum"), (torch.int64, "sum"), (torch.float64, "avg"))]
CASES += [("reduce_scatter", algo, torch.float32, "sum") for algo in ("ring", "direct")]
CASES += [("all_gather", algo, torch.float32, "sum") for algo in ("ring", "direct")]


def _comm(rank: int, world: int, name: str, policy: str):
    old = os.environ.get("PYCOMM_SHM_STORES")
    os.environ["PYCOMM_SHM_STORES"] = policy
    try:
        return make_comm(rank, world, f"{name}-{policy}")
    finally:
        if old is None:
            del os.environ["PYCOMM_SHM_STORES"]
        else:
            os.environ["PYCOMM_SHM_STORES"] = old


def _run(comm, rank: int, world: int, coll: str, algo: str, dtype: torch.dtype, count: int, op: str,
         seed: int) -> torch.Tensor:
    if coll == "all_reduce":
        x = make_input(seed, rank, count, dtype)
        comm.all_reduce(x, op, algorithm=algo)
        return x
    if coll == "reduce_scatter":
        x = torch.cat([make_input(seed, rank, count, dtype, shard=c) for c in range(world)])
        out = torch.empty(count, dtype=dtype)
        comm.reduce_scatter(out, x, op, algorithm=algo)
        return out
    out = torch.empty(count * world, dtype=dtype)
    comm.all_gather(out, make_input(seed, rank, count, dtype), algorithm=algo)
    return out


def modes_agree(rank: int, world: int, name: str) -> Dict[str, Dict[str, str]]:
    """Every case under each policy: its result's digest, by case and policy."""
    comms = {p: _comm(rank, world, name, p) for p in ("cached", "streaming", "auto")}
    out: Dict[str, Dict[str, str]] = {}
    for i, (coll, algo, dtype, op) in enumerate(CASES):
        for count in COUNTS:
            key = f"{coll}/{algo}/{str(dtype)[6:]}/{op}/{count}"
            out[key] = {p: digest(_run(c, rank, world, coll, algo, dtype, count, op, seed=i * 10 + count % 7))
                        for p, c in comms.items()}
    for c in comms.values():
        c.close()
    return out


def auto_over_many_calls(rank: int, world: int, name: str, calls: int) -> List[Tuple[int, str, str]]:
    """`calls` all-reduces of one size class under auto (which samples the
    streaming mode every 64th call of the class at least), each against the
    cached communicator's result on the same fresh data: the mismatches."""
    cached, auto = _comm(rank, world, name, "cached"), _comm(rank, world, name, "auto")
    bad = []
    for k in range(calls):
        x = make_input(1000 + k, rank, 300007, torch.float32)
        y = x.clone()
        cached.all_reduce(x)
        auto.all_reduce(y)
        if not torch.equal(x, y):
            bad.append((k, digest(x), digest(y)))
    cached.close()
    auto.close()
    return bad


def bad_policy(rank: int, world: int, name: str) -> str:
    try:
        _comm(rank, world, name, "fast").close()
    except Exception as e:  # noqa: BLE001 - the message is the point
        return f"{type(e).__name__}: {e}"
    return "no error"
