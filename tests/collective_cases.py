"""Worker-side sweeps of the collective matrix (run inside harness workers).

Inputs are fresh random data, seeded per (case, rank) so that every rank can
rebuild every other rank's input and compute the expected result in float64.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Tuple

import torch

from harness import make_comm

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
# 0, 1, tiny, primes, and sizes that cross chunk and (64 KiB) round boundaries
# unevenly for every world size; the largest (several rounds) for two dtypes.
COUNTS = [0, 1, 2, 3, 7, 31, 1021, 16411]
LARGE_COUNT = 70001
LARGE_DTYPES = (torch.float32, torch.int64)
EPS = {torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def ops_for(dtype: torch.dtype) -> List[str]:
    if dtype == torch.float32:
        return ["sum", "avg", "max", "min"]
    if dtype in (torch.int32, torch.int64):
        return ["sum", "max", "min"]
    if dtype == torch.float64:
        return ["sum", "avg"]
    return ["sum", "max"]


def make_input(seed: int, rank: int, n: int, dtype: torch.dtype, shard: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 7919 + rank) * 131 + shard)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def check_reduction(out: torch.Tensor, xs: List[torch.Tensor], op: str, dtype: torch.dtype) -> Optional[str]:
    """None if `out` is the reduction of xs within the stated bound, else why not.

    Bound for sums: world * eps(dtype) * sum(|x|) per element. A sum rounded
    once per hop (ring, tree) loses at most eps/2 of a partial sum, itself at
    most sum(|x|), at each of fewer than `world` hops. Integers, max and min
    are exact.
    """
    world = len(xs)
    stack = torch.stack([x.double() for x in xs]) if xs else None
    if op in ("sum", "avg"):
        exp = stack.sum(0)
        if op == "avg":
            exp = exp / world
    elif op == "max":
        exp = stack.max(0).values
    else:
        exp = stack.min(0).values
    got = out.double()
    if not dtype.is_floating_point or op in ("max", "min"):
        bad = (got != exp).nonzero()
        return None if bad.numel() == 0 else f"{bad.numel()} wrong, first at {bad[0].item()}: {got[bad[0]].item()} vs {exp[bad[0]].item()}"
    bound = world * EPS[dtype] * stack.abs().sum(0) + EPS[dtype] * exp.abs() + 1e-300
    err = (got - exp).abs()
    bad = (err > bound).nonzero()
    if bad.numel():
        i = bad[0].item()
        return f"{bad.numel()} outside bound, first at {i}: {got[i].item()} vs {exp[i].item()} (bound {bound[i].item():.3g})"
    return None


def sweep(rank: int, world: int, name: str, coll: str, algos: List[str], dtypes: List[torch.dtype] = DTYPES,
          **comm_kwargs) -> List[Tuple[str, Optional[str], str]]:
    """Runs every (algorithm, dtype, count, op) case of one collective (the
    dtypes of ``dtypes``, default all); returns (case, error or None, digest
    of the result) per case. ``comm_kwargs`` go to the Communicator (e.g.
    transport="pg", local_size=2)."""
    kwargs = dict(round_bytes=64 * 1024, timeout=60)
    kwargs.update(comm_kwargs)
    comm = make_comm(rank, world, name, **kwargs)
    results = []
    for algo in algos:
        results += sweep_on(comm, rank, world, coll, algo, seed=len(results), dtypes=dtypes)
    comm.close()
    return results


def sweep_on(comm, rank: int, world: int, coll: str, algo: str, seed: int = 0,
             dtypes: List[torch.dtype] = DTYPES) -> List[Tuple[str, Optional[str], str]]:
    """Every (dtype, count, op) case of one collective and algorithm on
    ``comm`` (a Communicator, or anything with its collective methods)."""
    results = []
    for dtype in dtypes:
        ops = ops_for(dtype) if coll in ("all_reduce", "reduce_scatter") else ["-"]
        for count in COUNTS + ([LARGE_COUNT] if dtype in LARGE_DTYPES else []):
            for op in ops:
                seed += 1
                key = f"{coll}/{algo}/{str(dtype)[6:]}/{count}/{op}"
                results.append(_one(comm, rank, world, coll, algo, dtype, count, op, seed, key))
    return results


def _one(comm, rank, world, coll, algo, dtype, count, op, seed, key):
    # Replicated results must be bitwise identical on every rank (checked by
    # digest), so only rank 0 needs to check values against the reference.
    verify = rank == 0
    in_place = seed % 2 == 0
    err = None
    if coll == "all_reduce":
        mine = make_input(seed, rank, count, dtype)
        x = mine.clone()
        out = x if in_place else torch.full_like(x, 7)
        comm.all_reduce(x, op, output=None if in_place else out, algorithm=algo)
        if not in_place and not torch.equal(x, mine):
            return key, "out-of-place all_reduce modified its input", ""
        if verify:
            xs = [make_input(seed, r, count, dtype) for r in range(world)]
            err = check_reduction(out, xs, op, dtype)
    elif coll == "reduce_scatter":
        # Inputs are built shard by shard, so each rank rebuilds only the
        # shard it checks.
        x = torch.cat([make_input(seed, rank, count, dtype, shard=c) for c in range(world)])
        # In place (NCCL's form, ZeRO-3's): the output is this rank's block of the input.
        out = x[rank * count:(rank + 1) * count] if in_place else torch.full((count,), 7, dtype=dtype)
        before = x.clone()
        comm.reduce_scatter(out, x, op, algorithm=algo)
        shards = [make_input(seed, r, count, dtype, shard=rank) for r in range(world)]
        err = check_reduction(out, shards, op, dtype)
        others = torch.ones(world * count, dtype=torch.bool)
        if in_place:
            others[rank * count:(rank + 1) * count] = False
        if err is None and not torch.equal(x[others], before[others]):
            err = "reduce_scatter modified its input" + (" outside this rank's block" if in_place else "")
    elif coll == "all_gather":
        mine = make_input(seed, rank, count, dtype)
        out = torch.full((count * world,), 7, dtype=dtype)
        if in_place:
            out[rank * count:(rank + 1) * count] = mine
            comm.all_gather(out, out[rank * count:(rank + 1) * count], algorithm=algo)
        else:
            comm.all_gather(out, mine.clone(), algorithm=algo)
        if verify:
            exp = torch.cat([make_input(seed, r, count, dtype) for r in range(world)])
            err = None if torch.equal(out, exp) else f"{(out != exp).sum().item()} wrong"
    else:  # broadcast, three roots per case
        errs = []
        for root in sorted({0, world - 1, world // 2}):
            x = make_input(seed + 1000 * root, rank, count, dtype)
            comm.broadcast(x, src=root, algorithm=algo)
            exp = make_input(seed + 1000 * root, root, count, dtype)
            if verify and not torch.equal(x, exp):
                errs.append(f"root {root}: {(x != exp).sum().item()} wrong")
        out = x
        err = "; ".join(errs) or None
    # Each rank holds a different shard after reduce_scatter: only replicated
    # results can be compared across ranks.
    return key, err, "" if coll == "reduce_scatter" else digest(out)


def matrix_failures(per_rank: List[List[Tuple[str, Optional[str], str]]]) -> List[str]:
    """The failing cases of a sweep's per-rank results: wrong values, or
    replicated results that differ between ranks in any bit."""
    failures = []
    for i, (key, _, _) in enumerate(per_rank[0]):
        errors = [(r, res[i][1]) for r, res in enumerate(per_rank) if res[i][1]]
        if errors:
            failures.append(f"{key}: " + "; ".join(f"rank {r}: {e}" for r, e in errors[:2]))
        digests = {res[i][2] for res in per_rank}
        if len(digests) != 1:
            failures.append(f"{key}: ranks disagree bitwise")
    return failures


# The reduce kernel's contract, shared by the kernel tests and the c10d dtype sweep.
COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul,
           "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def reduce_ops(dtype):
    """The ops the kernel takes for `dtype` (the core's check_reducible)."""
    ops = ["sum", "max", "min", "product"]
    return ops + (["avg"] if dtype.is_floating_point else ["band", "bor", "bxor"])


def reduce_reference(xs, op):
    """What every rank must compute: sources combined in list order, 16-bit floats in float32, rounded once;
    bools as 0/1 with sum and max meaning OR, product and min AND."""
    if xs[0].dtype == torch.bool:
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = acc | x if op in ("sum", "max") else acc & x if op in ("product", "min") else COMBINE[op](acc, x)
        return acc
    acc_dtype = torch.float32 if xs[0].dtype in (torch.float16, torch.bfloat16) else xs[0].dtype
    acc = xs[0].to(acc_dtype)
    for x in xs[1:]:
        acc = COMBINE[op](acc, x.to(acc_dtype))
    out = acc.to(xs[0].dtype)
    if op == "avg":
        out = (out.to(acc_dtype) / len(xs)).to(xs[0].dtype)
    return out


def program_sweep(rank: int, world: int, name: str) -> List[Tuple[str, Optional[str]]]:
    """The CUDA executor's program (every rank's, run on the CPU in this
    process: ``simulate_program``) against this communicator's all-reduce with
    the same algorithm and round size: the bits must be equal. Rank 0 checks;
    the others only take part. Returns (case, error or None) per case."""
    from pycomm import load_core
    from pycomm._tables import REDUCE_OPS
    core = load_core()
    comm = make_comm(rank, world, name, round_bytes=64 * 1024, timeout=60)
    all_reduce = core.collectives.index("all_reduce")
    results = []
    seed = 0
    for algo in ("ring", "tree", "direct"):
        for dtype in DTYPES:
            for count in COUNTS + [LARGE_COUNT]:
                for op in ops_for(dtype):
                    seed += 1
                    key = f"{algo}/{str(dtype)[6:]}/{count}/{op}"
                    x = make_input(seed, rank, count, dtype)
                    comm.all_reduce(x, op, algorithm=algo)
                    if rank != 0:
                        continue
                    # "direct" as the communicator resolves it (the tuner sees the bytes).
                    concrete = core.tune(core.algorithms[algo], all_reduce, count * x.element_size(), world)
                    xs = [make_input(seed, r, count, dtype) for r in range(world)]
                    outs = [torch.full_like(x, 7) for _ in range(world)]
                    core.simulate_program(concrete, all_reduce, 0, REDUCE_OPS[op], xs, outs, comm.round_bytes)
                    wrong = [r for r in range(world) if not torch.equal(outs[r].view(torch.uint8), x.view(torch.uint8))]
                    results.append((key, f"ranks {wrong} of the program differ from the communicator" if wrong else None))
    comm.close()
    return results
