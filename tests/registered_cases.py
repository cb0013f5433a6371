"""Worker-side cases of registered memory (comm.empty / comm.register).

Every matrix case runs one collective twice on the same fresh random data:
on ordinary tensors, then on tensors in registered memory (views into two
registered pools, at offsets that differ between ranks), with the same
algorithm. The results must be bitwise equal, replicated results bitwise
equal on every rank, and the registered call must have run in place exactly
when every rank's buffers allow it (counted by comm.in_place_calls).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from collective_cases import DTYPES, digest, make_input, ops_for
from harness import make_comm

POOL_BYTES = 6 << 20
COUNTS = [0, 1, 7, 1021, 16411, 70001]
COLLECTIVES = {
    "all_reduce": ["ring", "tree", "direct", "auto"],
    "reduce_scatter": ["ring", "direct", "auto"],
    "all_gather": ["ring", "direct", "auto"],
    "broadcast": ["ring", "tree", "direct", "auto"],
    "all_to_all": ["auto"],
}


def _view(pool: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    return pool[offset:offset + n * es].view(dtype)


def _resolved(comm, coll: str, algo: str, nbytes: int) -> str:
    if coll == "all_to_all":
        return "direct(two-shot)"
    return comm.resolve_algorithm(coll, algo, nbytes)


def _one(comm, rank: int, world: int, coll: str, algo: str, dtype: torch.dtype, count: int, op: str, seed: int,
         pools: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[str, Optional[str], str]:
    key = f"{coll}/{algo}/{str(dtype)[6:]}/{count}/{op}"
    es = torch.empty(0, dtype=dtype).element_size()
    off_a, off_b = 8 * ((seed + rank) % 9), 8 * ((seed + 2 * rank) % 5)
    variant = seed % 3
    pa, pb = pools

    def reg(pool, off, n):
        return _view(pool, off, n, dtype)

    def filled(n):
        return torch.full((n,), 7, dtype=dtype)

    # Per collective: the plain call's result, the registered call's, and
    # whether the registered call runs in place (every rank uses the same
    # variant, so every rank's buffers are registered alike).
    if coll == "all_reduce":
        mine = make_input(seed, rank, count, dtype)
        ref = mine.clone()
        comm.all_reduce(ref, op, algorithm=algo)
        # 0: in place; 1: registered input and output; 2: plain input,
        # registered output; plus, on odd seeds, 3: registered input, plain output.
        variant = 3 if seed % 2 and variant == 0 else variant
        x = mine.clone() if variant == 2 else reg(pa, off_a, count).copy_(mine)
        out = x if variant == 0 else (filled(count) if variant == 3 else reg(pb, off_b, count).fill_(7))
        before = comm.in_place_calls
        comm.all_reduce(x, op, output=None if variant == 0 else out, algorithm=algo)
        if variant != 0 and not torch.equal(x, mine):
            return key, f"variant {variant}: the out-of-place input changed", ""
        in_place = variant != 3 and _resolved(comm, coll, algo, count * es) == "direct(two-shot)"
    elif coll == "reduce_scatter":
        x_plain = torch.cat([make_input(seed, rank, count, dtype, shard=c) for c in range(world)])
        ref = filled(count)
        comm.reduce_scatter(ref, x_plain, op, algorithm=algo)
        # 0: registered input; 1: registered input and output; 2: plain input,
        # registered output; plus, on odd seeds, 3: in place (NCCL's form: the
        # output this rank's block of the registered input).
        variant = 3 if seed % 2 and variant == 0 else variant
        x = x_plain.clone() if variant == 2 else reg(pa, off_a, count * world).copy_(x_plain)
        out = (filled(count) if variant == 0 else x[rank * count:(rank + 1) * count] if variant == 3
               else reg(pb, off_b, count).fill_(7))
        before = comm.in_place_calls
        comm.reduce_scatter(out, x, op, algorithm=algo)
        in_place = variant != 2 and _resolved(comm, coll, algo, count * world * es) == "direct(two-shot)"
    elif coll == "all_gather":
        mine = make_input(seed, rank, count, dtype)
        ref = filled(count * world)
        comm.all_gather(ref, mine.clone(), algorithm=algo)
        # 0: registered input; 1: in place in a registered output; 2: plain input, registered output.
        if variant == 1:
            out = reg(pb, off_b, count * world).fill_(7)
            x = out[rank * count:(rank + 1) * count]
            x.copy_(mine)
        else:
            x = reg(pa, off_a, count).copy_(mine) if variant == 0 else mine.clone()
            out = filled(count * world) if variant == 0 else reg(pb, off_b, count * world).fill_(7)
        before = comm.in_place_calls
        comm.all_gather(out, x, algorithm=algo)
        in_place = variant != 2 and _resolved(comm, coll, algo, count * world * es) == "direct(two-shot)"
    elif coll == "broadcast":
        root = seed % world
        ref = make_input(seed, rank, count, dtype)
        comm.broadcast(ref, src=root, algorithm=algo)
        out = reg(pa, off_a, count).copy_(make_input(seed, rank, count, dtype))
        before = comm.in_place_calls
        comm.broadcast(out, src=root, algorithm=algo)
        in_place = _resolved(comm, coll, algo, count * es) == "direct(one-shot)"
    else:  # all_to_all: `count` elements per block
        x_plain = torch.cat([make_input(seed, rank, count, dtype, shard=c) for c in range(world)])
        ref = filled(count * world)
        comm.all_to_all_single(ref, x_plain)
        x = x_plain.clone() if variant == 2 else reg(pa, off_a, count * world).copy_(x_plain)
        out = filled(count * world) if variant == 0 else reg(pb, off_b, count * world).fill_(7)
        before = comm.in_place_calls
        comm.all_to_all_single(out, x)
        in_place = variant != 2
    in_place = in_place and world > 1 and count > 0
    ran = comm.in_place_calls - before
    err = None
    if ran != int(in_place):
        err = f"variant {variant}: ran in place {ran} times, expected {int(in_place)}"
    elif not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
        err = f"variant {variant}: differs from the unregistered call in {(out != ref).sum().item()} elements"
    replicated = coll not in ("reduce_scatter", "all_to_all")
    return key, err, digest(out) if replicated else ""


def sweep(rank: int, world: int, name: str, colls: List[str]) -> List[Tuple[str, Optional[str], str]]:
    """Every (collective, algorithm, dtype, count, op) case on one communicator."""
    comm = make_comm(rank, world, name, round_bytes=64 * 1024, timeout=60)
    pools = (comm.empty(POOL_BYTES, dtype=torch.uint8), comm.empty(POOL_BYTES, dtype=torch.uint8))
    results, seed = [], 0
    for coll in colls:
        for algo in COLLECTIVES[coll]:
            for dtype in DTYPES:
                ops = ops_for(dtype) if coll in ("all_reduce", "reduce_scatter") else ["-"]
                for count in COUNTS:
                    for op in ops:
                        seed += 1
                        results.append(_one(comm, rank, world, coll, algo, dtype, count, op, seed, pools))
    comm.close()
    return results


def large(rank: int, world: int, name: str) -> List[str]:
    """Larger-than-a-block all-reduces (several 256 KiB blocks per shard, odd
    sizes), in place and out of place, against the unregistered call."""
    comm = make_comm(rank, world, name, timeout=60)
    problems = []
    for n, dtype, op in ((1_100_003, torch.float32, "sum"), (700_001, torch.bfloat16, "avg"),
                         (400_009, torch.int64, "max")):
        mine = make_input(n, rank, n, dtype)
        ref = mine.clone()
        comm.all_reduce(ref, op)
        r = comm.empty(n, dtype=dtype).copy_(mine)
        o = comm.empty(n, dtype=dtype)
        before = comm.in_place_calls
        comm.all_reduce(r, op, output=o)
        comm.all_reduce(r, op)
        if comm.in_place_calls - before != 2:
            problems.append(f"{n} {dtype}: did not run in place")
        for what, t in (("out of place", o), ("in place", r)):
            if not torch.equal(t.view(torch.uint8), ref.view(torch.uint8)):
                problems.append(f"{n} {dtype} {what}: {(t != ref).sum().item()} elements differ")
    comm.close()
    return problems


def mixed_ranks(rank: int, world: int, name: str) -> Dict[str, Any]:
    """Only some ranks' buffers are registered: every rank runs the staged
    path, results unchanged."""
    comm = make_comm(rank, world, name, timeout=60)
    n = 50_000
    mine = make_input(5, rank, n, torch.float32)
    ref = mine.clone()
    comm.all_reduce(ref)
    reg = comm.empty(n)  # collective: every rank allocates
    x = reg.copy_(mine) if rank % 2 == 0 else mine.clone()
    before = comm.in_place_calls
    comm.all_reduce(x)
    # Two registered buffers in different allocations: staged too.
    a, b = comm.empty(n), comm.empty(n)
    y = (a if rank == 0 else b).copy_(mine)
    comm.all_reduce(y)
    out = dict(in_place=comm.in_place_calls - before, equal=torch.equal(x, ref) and torch.equal(y, ref))
    comm.close()
    return out


def errors(rank: int, world: int, name: str) -> Dict[str, str]:
    """A registered tensor of another communicator, resize, sizes that
    differ between ranks, and what stays usable afterwards."""
    out: Dict[str, str] = {}
    a = make_comm(rank, world, name + "a", timeout=30)
    b = make_comm(rank, world, name + "b", timeout=30)
    t = a.empty(1000)
    t.fill_(rank + 1)
    try:
        b.all_reduce(t)
        out["foreign"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["foreign"] = f"{type(e).__name__}: {e}"
    try:
        t.resize_(10_000)
        out["resize"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["resize"] = f"{type(e).__name__}: {e}"
    t.resize_(10)  # shrinking within the storage is harmless
    try:
        a.empty(1000 + rank)
        out["sizes"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["sizes"] = f"{type(e).__name__}: {e}"
    # Both communicators still work, registered memory too.
    u = a.empty(100_000).fill_(rank + 1)
    a.all_reduce(u)
    v = torch.full((100,), rank + 1.0)
    b.all_reduce(v)
    out["after"] = str(bool((u == world * (world + 1) / 2).all()) and bool((v == world * (world + 1) / 2).all()))
    out["registered"] = f"{a.is_registered(u)} {b.is_registered(u)} {a.is_registered(v)}"
    # register(): the same Python object, now in registered memory.
    p = torch.nn.Parameter(torch.full((100_000,), float(rank + 1)))
    q = a.register(p)
    a.all_reduce(p.data)
    out["register"] = f"{q is p} {a.is_registered(p)} {bool((p == world * (world + 1) / 2).all())}"
    # Memory outlives its communicator.
    a.close()
    out["after close"] = str(float(u[0]))
    b.close()
    return out


def segment_mode(rank: int, world: int, name: str) -> List[str]:
    """Mode of every registered mapping of this process (0600 expected) and
    names of this communicator left in /dev/shm (none expected)."""
    comm = make_comm(rank, world, name, timeout=30)
    t = comm.empty(4096)
    modes = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/pycomm." in line and ".m" in line.split("/dev/shm/")[1]:
                rng = line.split()[0]
                modes.append(oct(os.stat(f"/proc/self/map_files/{rng}").st_mode & 0o777))
    left = [f for f in os.listdir("/dev/shm") if f.startswith("pycomm.") and ".m" in f]
    del t
    comm.close()
    return modes + [f"left: {x}" for x in left]


# ------------------------------------------------------------- kill -9 trial

def _kill_rank(rank: int, world: int, port: int, conn, seed: int) -> None:
    import reliability_cases as rc

    store, comm = rc._bootstrap(rank, world, port, "reg", 5.0)
    conn.send("ready")
    calls = 0
    try:
        while True:
            # Allocations and in-place all-reduces, so that the kill lands in
            # either.
            t = comm.empty(70_001 + (calls % 3) * 1024)
            t.fill_(1.0)
            comm.all_reduce(t)
            if float(t[0]) != world:
                raise AssertionError(f"wrong result {float(t[0])}")
            calls += 1
    except Exception as e:  # noqa: BLE001
        conn.send(f"{type(e).__name__}: {e}")


def kill_trial(world: int, seed: int) -> Dict[str, Any]:
    """kill -9 a random rank while ranks allocate registered memory and
    reduce in it: survivors raise, nothing hangs, nothing stays in /dev/shm."""
    import random

    import reliability_cases as rc

    rng = random.Random(seed)
    victim = rng.randrange(world)
    before = rc.shm_entries()
    store_pid, pids, conns = rc.fork_ranks(world, _kill_rank, seed)
    for c in conns:
        if not c.poll(rc.START_S) or c.recv() != "ready":
            rc.reap(pids + [store_pid], 0)
            raise AssertionError("a rank did not start")
    time.sleep(rng.uniform(0.05, 0.4))
    os.kill(pids[victim], signal.SIGKILL)
    errs = {}
    for r, c in enumerate(conns):
        if r != victim:
            errs[r] = c.recv() if c.poll(20) else None
    hung = rc.reap(pids, time.monotonic() + 15)
    rc.reap([store_pid], 0)
    return dict(victim=victim, errors=errs, hung=len(hung), leaked=sorted(rc.shm_entries() - before))


def coalesced(rank: int, world: int, name: str) -> List[str]:
    """Coalesced calls pack into registered scratch and run in place: the
    Python one, and the c10d backend's (async, several queued at once),
    bitwise equal to one unregistered all-reduce of the concatenation."""
    import torch.distributed as dist

    comm = make_comm(rank, world, name, timeout=60)
    problems = []
    sizes = (1000, 70001, 12345)
    for step, op in enumerate(("sum", "avg")):
        ts = [make_input(10 * step + i, rank, n, torch.float32).view(-1, 1) for i, n in enumerate(sizes)]
        ref = torch.cat([t.reshape(-1) for t in ts])
        comm.all_reduce(ref, op)
        before = comm.in_place_calls
        comm.all_reduce_coalesced(ts, op=op)
        if comm.in_place_calls - before != 1:
            problems.append(f"python {op}: did not run in place")
        if not torch.equal(torch.cat([t.reshape(-1) for t in ts]), ref):
            problems.append(f"python {op}: differs from the flat all-reduce")
    backend = comm.as_c10d_backend()
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    lists, refs, works = [], [], []
    for k in range(3):
        ts = [make_input(100 + 10 * k + i, rank, n + k, torch.float32) for i, n in enumerate(sizes)]
        ref = torch.cat(ts)
        comm.all_reduce(ref)
        lists.append(ts)
        refs.append(ref)
    before = comm.in_place_calls
    for ts in lists:
        opts.asyncOp = True
        works.append(backend.allreduce_coalesced(ts, opts))
    for w in works:
        w.wait()
    if comm.in_place_calls - before != 3:
        problems.append(f"c10d: {comm.in_place_calls - before} of 3 calls ran in place")
    for k, (ts, ref) in enumerate(zip(lists, refs)):
        if not torch.equal(torch.cat(ts), ref):
            problems.append(f"c10d call {k}: differs from the flat all-reduce")
    comm.close()
    return problems


def on_hosts(rank: int, world: int, name: str, local: int) -> List[str]:
    """Simulated hosts: registered tensors work in every collective (their
    local parts may run in place), bitwise equal to ordinary ones."""
    comm = make_comm(rank, world, name, timeout=60, local_size=local)
    problems = []
    seed = 0
    for n in (1021, 70001, 300007):
        for coll, algos in (("all_reduce", ["auto", "ring", "hierarchical"]), ("reduce_scatter", ["auto", "ring"]),
                            ("all_gather", ["auto", "ring"]), ("broadcast", ["auto", "hierarchical"])):
            for algo in algos:
                seed += 1
                k = n * world if coll == "reduce_scatter" else n
                mine = make_input(seed, rank, k, torch.float32)
                out_n = n * world if coll == "all_gather" else n
                results = []
                for empty in (torch.empty, comm.empty):
                    x = empty(k, dtype=torch.float32)
                    x.copy_(mine)
                    out = empty(out_n, dtype=torch.float32)
                    if coll == "all_reduce":
                        comm.all_reduce(x, "avg", output=out, algorithm=algo)
                    elif coll == "reduce_scatter":
                        comm.reduce_scatter(out, x, "sum", algorithm=algo)
                    elif coll == "all_gather":
                        comm.all_gather(out, x, algorithm=algo)
                    else:
                        comm.broadcast(x, src=seed % world, algorithm=algo)
                        out = x
                    results.append(out.clone())
                if not torch.equal(results[0], results[1]):
                    problems.append(f"{coll}/{algo}/{n}: registered differs from ordinary")
    comm.close()
    return problems
