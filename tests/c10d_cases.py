"""Worker-side cases for pycomm as a torch.distributed backend (run inside
harness workers). Every worker joins one default group on "cpu:pycomm";
cases build subgroups of it."""
from __future__ import annotations

import datetime
import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from collective_cases import make_input, reduce_ops, reduce_reference, sweep_on
from harness import worker_store

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR}

# Every dtype a copy collective must move, and the ones Gloo reduces.
COPY_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
               torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
               torch.complex128, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]


def init_default(rank: int, world: int, name: str, timeout: float = 60) -> str:
    """dist.init_process_group("cpu:pycomm") over the whole pool."""
    if not dist.is_initialized():
        dist.init_process_group("cpu:pycomm", store=dist.PrefixStore(name, worker_store()), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_backend()


def _group(world: int, backend: str = "pycomm", algo: Optional[str] = None):
    """A new subgroup of ranks 0..world-1. Every rank of the pool calls this
    (torch names groups by creation order); ranks outside get None."""
    old = os.environ.get("PYCOMM_ALGO")
    if algo:
        os.environ["PYCOMM_ALGO"] = algo
    try:
        g = dist.new_group(list(range(world)), backend=backend)
        return g if dist.get_rank() < world else None
    finally:
        if old is None:
            os.environ.pop("PYCOMM_ALGO", None)
        else:
            os.environ["PYCOMM_ALGO"] = old


class DistComm:
    """The Communicator's collective methods, done with torch.distributed
    calls on a group. List and tensor forms alternate from call to call."""

    def __init__(self, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.calls = 0

    def _flip(self) -> bool:
        self.calls += 1
        return self.calls % 2 == 0

    def all_reduce(self, x, op="sum", output=None, algorithm=None):
        if output is not None:  # torch's all_reduce is in place only
            output.copy_(x)
            x = output
        if self._flip():
            dist.all_reduce(x, op=_OPS[op], group=self.group)
        else:
            dist.all_reduce(x, op=_OPS[op], group=self.group, async_op=True).wait()

    def reduce_scatter(self, out, x, op="sum", algorithm=None):
        if self._flip():
            dist.reduce_scatter_tensor(out, x, op=_OPS[op], group=self.group)
        else:
            dist.reduce_scatter(out, list(x.view(self.world, -1).unbind(0)), op=_OPS[op], group=self.group)

    def all_gather(self, out, inp, algorithm=None):
        if self._flip():
            dist.all_gather_into_tensor(out, inp, group=self.group)
        else:
            dist.all_gather(list(out.view(self.world, -1).unbind(0)), inp, group=self.group)

    def broadcast(self, x, src=0, algorithm=None):
        dist.broadcast(x, src, group=self.group)


def matrix(rank: int, world: int, coll: str, algo: str) -> list:
    """The foundation's collective sweep, through torch.distributed calls."""
    group = _group(world, algo=None if algo == "auto" else algo)
    if group is None:
        return []
    try:
        return sweep_on(DistComm(group), rank, world, coll, algo)
    finally:
        dist.destroy_process_group(group)


def api(rank: int, world: int) -> Dict[str, object]:
    """Every torch.distributed call the backend serves, on fresh random data,
    checked against closed-form results. Returns what each check found."""
    g = _group(world)
    out: Dict[str, object] = {}
    if g is None:
        return out
    seed = 4242
    xs = [make_input(seed, r, 37, torch.float32) for r in range(world)]
    total = torch.stack([x.double() for x in xs]).sum(0)

    # all_reduce: future holds the tensor; then() continuations run.
    t = xs[rank].clone()
    fut = dist.all_reduce(t, group=g, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    out["all_reduce future"] = torch.allclose(fut.wait().double(), 2 * total, rtol=1e-5, atol=1e-4)

    # all_reduce_coalesced: tensors of several shapes, one call.
    parts = [make_input(seed + i, rank, n, torch.float64).view(shape)
             for i, (n, shape) in enumerate([(6, (2, 3)), (1, (1,)), (0, (0,)), (20, (4, 5))])]
    exp = [sum(make_input(seed + i, r, p.numel(), torch.float64) for r in range(world)).view(p.shape)
           for i, p in enumerate(parts)]
    dist.all_reduce_coalesced(parts, group=g)
    out["all_reduce_coalesced"] = all(torch.allclose(p, e) for p, e in zip(parts, exp))

    # reduce: the root gets the sum, the others keep their tensor.
    for root in sorted({0, world - 1}):
        t = xs[rank].clone()
        dist.reduce(t, dst=root, op=dist.ReduceOp.MAX, group=g)
        want = torch.stack(xs).max(0).values if rank == root else xs[rank]
        out[f"reduce root {root}"] = torch.equal(t, want)

    # gather / scatter to and from the last rank.
    root = world - 1
    gathered = [torch.empty(37) for _ in range(world)] if rank == root else None
    dist.gather(xs[rank], gathered, dst=root, group=g)
    out["gather"] = rank != root or all(torch.equal(a, b) for a, b in zip(gathered, xs))
    pieces = [make_input(seed + 7, r, 5, torch.int64) for r in range(world)]
    mine = torch.empty(5, dtype=torch.int64)
    dist.scatter(mine, pieces if rank == root else None, src=root, group=g)
    out["scatter"] = torch.equal(mine, pieces[rank])

    # all_to_all: lists, even single, uneven single (the peer group).
    blocks = [torch.full((3,), 100.0 * rank + p) for p in range(world)]
    recv = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(recv, blocks, group=g)
    out["all_to_all"] = all(torch.equal(recv[p], torch.full((3,), 100.0 * p + rank)) for p in range(world))
    # Rank r sends r + p + 1 elements to rank p (the peer group carries it).
    blocks = [torch.full((rank + p + 1,), 100.0 * rank + p) for p in range(world)]
    recv = [torch.empty(p + rank + 1) for p in range(world)]
    dist.all_to_all(recv, blocks, group=g)
    out["all_to_all uneven"] = all(torch.equal(recv[p], torch.full((p + rank + 1,), 100.0 * p + rank))
                                   for p in range(world))
    single = torch.arange(world * 2, dtype=torch.float32) + 1000 * rank
    got = torch.empty(world * 2)
    dist.all_to_all_single(got, single, group=g)
    out["all_to_all_single"] = torch.equal(
        got, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 1000 * p for p in range(world)]))
    # Rank r sends p + 1 elements to rank p.
    sizes_in = [p + 1 for p in range(world)]
    sizes_out = [rank + 1] * world
    src = torch.cat([torch.full((p + 1,), float(rank * 10 + p)) for p in range(world)])
    dst = torch.empty(sum(sizes_out))
    dist.all_to_all_single(dst, src, output_split_sizes=sizes_out, input_split_sizes=sizes_in, group=g)
    out["all_to_all_single uneven"] = torch.equal(
        dst, torch.cat([torch.full((rank + 1,), float(p * 10 + rank)) for p in range(world)]))

    # send / recv around a ring, blocking and not.
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        payload = make_input(seed + 11, rank, 1000, torch.float32)
        box = torch.empty(1000)
        reqs = [dist.isend(payload, nxt, group=g), dist.irecv(box, prv, group=g)]
        for q in reqs:
            q.wait()
        out["isend/irecv"] = torch.equal(box, make_input(seed + 11, prv, 1000, torch.float32))
        if rank == 0:
            dist.send(payload, 1, group=g, tag=5)
        elif rank == 1:
            box = torch.empty(1000)
            dist.recv(box, 0, group=g, tag=5)
            out["send/recv"] = torch.equal(box, make_input(seed + 11, 0, 1000, torch.float32))

    # Objects (pickled, padded uint8 all_gather and broadcast underneath).
    objs: List[object] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "tag": "x" * rank}, group=g)
    out["all_gather_object"] = objs == [{"rank": r, "tag": "x" * r} for r in range(world)]
    lst = [f"from {world - 1}", world] if rank == world - 1 else [None, None]
    dist.broadcast_object_list(lst, src=world - 1, group=g)
    out["broadcast_object_list"] = lst == [f"from {world - 1}", world]

    # Coalesced tensor pairs (what FSDP-style code calls on the group).
    ag_in = [torch.full((3,), float(rank)), torch.arange(5.0) + 10 * rank]
    ag_out = [torch.empty(world * 3), torch.empty(world * 5)]
    g.allgather_into_tensor_coalesced(ag_out, ag_in).wait()
    out["all_gather_into_tensor_coalesced"] = (
        torch.equal(ag_out[0], torch.cat([torch.full((3,), float(r)) for r in range(world)]))
        and torch.equal(ag_out[1], torch.cat([torch.arange(5.0) + 10 * r for r in range(world)])))
    rs_in = [make_input(seed + 20 + i, rank, world * m, torch.float64) for i, m in enumerate((2, 7))]
    rs_out = [torch.empty(2, dtype=torch.float64), torch.empty(7, dtype=torch.float64)]
    g.reduce_scatter_tensor_coalesced(rs_out, rs_in).wait()
    out["reduce_scatter_tensor_coalesced"] = all(
        torch.allclose(rs_out[i], sum(make_input(seed + 20 + i, r, world * m, torch.float64)
                                      for r in range(world))[rank * m:(rank + 1) * m])
        for i, m in enumerate((2, 7)))

    # A list of the wrong tensors: every rank raises, naming the call.
    try:
        dist.all_gather([torch.empty(4) for _ in range(world)], torch.ones(3), group=g)
        out["bad list"] = "no error"
    except RuntimeError as e:
        out["bad list"] = "all_gather" in str(e) and "size and dtype" in str(e)

    # all_gather_coalesced: tensors of several shapes, one call.
    mine = [make_input(seed + 30, rank, 6, torch.float32).view(2, 3), make_input(seed + 31, rank, 1, torch.float32)]
    lists = [[torch.empty(2, 3), torch.empty(1)] for _ in range(world)]
    dist.all_gather_coalesced(lists, mine, group=g)
    out["all_gather_coalesced"] = all(
        torch.equal(lists[r][0], make_input(seed + 30, r, 6, torch.float32).view(2, 3))
        and torch.equal(lists[r][1], make_input(seed + 31, r, 1, torch.float32)) for r in range(world))

    # Sparse all-reduce (the peer group): the dense sum of every rank's entries.
    dense = [torch.zeros(5, 4, dtype=torch.float64) for _ in range(world)]
    for r in range(world):
        gen = torch.Generator().manual_seed(seed + 40 + r)
        rows = torch.randperm(5, generator=gen)[:2]
        dense[r][rows] = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    sp = dense[rank].to_sparse()
    work = dist.all_reduce(sp, group=g, async_op=True)
    work.wait()
    got = work.result()[0] if work.result() else sp
    out["sparse all_reduce"] = torch.allclose(got.to_dense(), sum(dense))

    # PREMUL_SUM on an integral tensor (NCCL's scaled sum takes floating ones):
    # every rank raises, naming it; the group stays usable.
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0), group=g)
        out["PREMUL_SUM"] = "no error"
    except RuntimeError as e:
        out["PREMUL_SUM"] = f"{type(e).__name__}: {e}"
    dist.barrier(group=g)
    t = torch.ones(4)
    dist.all_reduce(t, group=g)
    out["usable after errors"] = torch.equal(t, torch.full((4,), float(world)))
    out["backend"] = dist.get_backend(g)
    dist.destroy_process_group(g)
    return out


def random_bits(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n elements of `dtype` with random bytes (bools 0/1): what a copy must move unchanged."""
    if dtype == torch.bool:
        return make_input(seed, rank, n, torch.int64) % 2 == 1
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype)


def _reduce_input(seed: int, rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    if dtype == torch.bool:
        return make_input(seed, rank, n, torch.int64) % 3 == 0
    if op == "product":  # values whose product stays representable
        g = torch.Generator().manual_seed(seed * 17 + rank)
        if dtype.is_floating_point:
            return (0.75 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)
        return torch.randint(-3, 4, (n,), generator=g, dtype=torch.int64).to(dtype)
    if op in ("band", "bor", "bxor"):
        g = torch.Generator().manual_seed(seed * 13 + rank)
        lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128) if dtype == torch.int8 else (-2**30, 2**30)
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
    return make_input(seed, rank, n, dtype) if dtype.is_floating_point else (
        make_input(seed, rank, n, torch.int64) % 100).to(dtype)


def dtypes(rank: int, world: int) -> Dict[str, object]:
    """Every dtype through every copy collective (bytes unchanged), and every
    reducible dtype with every op it takes through all_reduce, reduce and
    reduce_scatter, against the closed form. Returns failures and counts."""
    g = _group(world)
    if g is None:
        return {}
    seed = 777 + world
    failures: List[str] = []
    checked = 0
    root = world - 1
    for i, dt in enumerate(COPY_DTYPES):
        n = 11 + i
        xs = [random_bits(seed + i, r, n, dt) for r in range(world)]
        same = lambda a, b: a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
        t = xs[rank].clone() if rank == root else torch.zeros_like(xs[0])
        dist.broadcast(t, src=root, group=g)
        checks = {"broadcast": same(t, xs[root])}
        outs = [torch.zeros_like(xs[0]) for _ in range(world)]
        dist.all_gather(outs, xs[rank], group=g)
        checks["all_gather"] = all(same(outs[r], xs[r]) for r in range(world))
        flat = torch.zeros(world * n, dtype=dt)
        dist.all_gather_into_tensor(flat, xs[rank], group=g)
        checks["all_gather_into_tensor"] = same(flat, torch.cat(xs))
        gathered = [torch.zeros_like(xs[0]) for _ in range(world)] if rank == root else None
        dist.gather(xs[rank], gathered, dst=root, group=g)
        checks["gather"] = rank != root or all(same(gathered[r], xs[r]) for r in range(world))
        pieces = [random_bits(seed + 50 + i, r, n, dt) for r in range(world)]
        got = torch.zeros_like(xs[0])
        dist.scatter(got, pieces if rank == root else None, src=root, group=g)
        checks["scatter"] = same(got, pieces[rank])
        blocks = [random_bits(seed + 90 + i, r, world * 3, dt) for r in range(world)]
        recv = torch.zeros(world * 3, dtype=dt)
        dist.all_to_all_single(recv, blocks[rank], group=g)
        checks["all_to_all_single"] = same(recv, torch.cat([blocks[p][3 * rank:3 * rank + 3] for p in range(world)]))
        lists = [[torch.zeros_like(xs[0])] for _ in range(world)]
        dist.all_gather_coalesced(lists, [xs[rank]], group=g)
        checks["all_gather_coalesced"] = all(same(lists[r][0], xs[r]) for r in range(world))
        for name, ok in checks.items():
            checked += 1
            if not ok:
                failures.append(f"{name} {dt}")
    for i, dt in enumerate(FLOAT_DTYPES + INT_DTYPES + [torch.bool]):
        for j, op in enumerate(reduce_ops(dt)):
            n = 3 * world + j
            xs = [_reduce_input(seed + 100 * i + j, r, n, dt, op) for r in range(world)]
            want = reduce_reference(xs, op)
            tol = {} if not dt.is_floating_point else dict(rtol=2e-2 if dt in (torch.float16, torch.bfloat16)
                                                            else 1e-5, atol=1e-3)
            match = (lambda a, b: torch.allclose(a.double(), b.double(), **tol)) if tol else torch.equal
            t = xs[rank].clone()
            dist.all_reduce(t, op=_OPS[op], group=g)
            results = {"all_reduce": match(t, want)}
            t = xs[rank].clone()
            dist.reduce(t, dst=root, op=_OPS[op], group=g)
            results["reduce"] = match(t, want) if rank == root else torch.equal(t, xs[rank])
            shard = torch.zeros(n // world, dtype=dt)
            k = n // world
            dist.reduce_scatter_tensor(shard, torch.cat([x[:k * world] for x in xs[rank:rank + 1]]), op=_OPS[op],
                                       group=g)
            results["reduce_scatter_tensor"] = match(shard, want[rank * k:(rank + 1) * k])
            for name, ok in results.items():
                checked += 1
                if not ok:
                    failures.append(f"{name} {dt} {op}")
    # What cannot work says so on every rank, and the group stays usable.
    return dict(failures=failures, checked=checked, **_refusals_then_close(g, world, {
        "band float32": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, group=g),
        "avg int32": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG, group=g),
        "sum int16": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16), group=g),
    }))


def _refusals_then_close(g, world: int, calls: Dict[str, Callable[[], object]]) -> Dict[str, object]:
    """What each call that cannot work raised on this rank ("no error" if
    none), whether the group still sums right after them, and the group closed."""
    refusals = {}
    for what, call in calls.items():
        try:
            call()
            refusals[what] = "no error"
        except (RuntimeError, ValueError, TypeError) as e:
            refusals[what] = f"{type(e).__name__}: {e}"
    t = torch.ones(4)
    dist.all_reduce(t, group=g)
    usable = torch.equal(t, torch.full((4,), float(world)))
    dist.destroy_process_group(g)
    return {"refusals": refusals, "usable": usable}


def premul_sum(rank: int, world: int) -> Dict[str, object]:
    """ReduceOp.PREMUL_SUM (NCCL's scaled sum: each rank's input times its own
    factor, then a sum) through every reducing call, with a number and a
    one-element tensor as the factor, floating dtypes. Each result equals,
    bit for bit, SUM over inputs the test scaled itself, and the closed form
    (float64) within the dtype's rounding; the caller's input is unchanged
    where the call does not write it. Returns failures, checks and refusals."""
    g = _group(world)
    if g is None:
        return {}
    seed = 4040 + world
    failures: List[str] = []
    checked = 0
    root = world - 1
    factor = lambda r: 0.5 + 0.25 * r  # noqa: E731  (a different factor per rank, exact in every dtype)
    for i, dt in enumerate(FLOAT_DTYPES):
        for as_tensor in (False, True):
            n = 5 * world + i
            xs = [make_input(seed + 10 * i, r, n, dt) for r in range(world)]
            scaled = [(x * factor(r)).to(dt) for r, x in enumerate(xs)]
            f = torch.tensor([factor(rank)], dtype=dt if as_tensor and i % 2 else torch.float64)
            op = dist._make_nccl_premul_sum(f if as_tensor else factor(rank))
            tol = dict(rtol=2e-2 if dt in (torch.float16, torch.bfloat16) else 1e-5, atol=1e-3)
            want = sum(x.double() for x in scaled)
            results = {}

            def same(call, got, ref, part=slice(None)):
                # `ref`: this call with SUM over the inputs scaled here (the same bits expected).
                results[call] = (got.dtype == dt and torch.equal(got, ref)
                                 and torch.allclose(got.double(), want[part], **tol))

            t, ref = xs[rank].clone(), scaled[rank].clone()
            dist.all_reduce(t, op=op, group=g)
            dist.all_reduce(ref, group=g)
            same("all_reduce", t, ref)
            wide = torch.stack([xs[rank], xs[rank]], 1)[:, 0]  # not contiguous: through the contiguous copy
            dist.all_reduce(wide, op=op, group=g)
            same("all_reduce strided", wide, ref)
            t, ref = xs[rank].clone(), scaled[rank].clone()
            dist.reduce(t, dst=root, op=op, group=g)
            dist.reduce(ref, dst=root, group=g)
            if rank == root:
                same("reduce", t, ref)
            else:
                results["reduce"] = torch.equal(t, xs[rank])  # the caller's tensor, untouched
            k = n // world
            mine = xs[rank][:k * world].clone()
            shard, ref = torch.empty(k, dtype=dt), torch.empty(k, dtype=dt)
            dist.reduce_scatter_tensor(shard, mine, op=op, group=g)
            dist.reduce_scatter_tensor(ref, scaled[rank][:k * world].contiguous(), group=g)
            same("reduce_scatter_tensor", shard, ref, slice(rank * k, (rank + 1) * k))
            results["reduce_scatter_tensor input"] = torch.equal(mine, xs[rank][:k * world])
            shard = torch.empty(k, dtype=dt)
            dist.reduce_scatter(shard, list(mine.chunk(world)), op=op, group=g)
            same("reduce_scatter", shard, ref, slice(rank * k, (rank + 1) * k))
            results["reduce_scatter inputs"] = torch.equal(mine, xs[rank][:k * world])
            pair, refs = [xs[rank][:3].clone(), xs[rank][3:].clone()], [scaled[rank][:3].clone(),
                                                                        scaled[rank][3:].clone()]
            g.allreduce_coalesced(pair, _coalesced(op)).wait()
            dist.all_reduce(refs[0], group=g)
            dist.all_reduce(refs[1], group=g)
            results["all_reduce_coalesced"] = (torch.equal(pair[0], refs[0]) and torch.equal(pair[1], refs[1])
                                               and torch.allclose(torch.cat(pair).double(), want, **tol))
            rs_opts = dist.ReduceScatterOptions()
            rs_opts.reduceOp = op
            outs = [torch.empty(k, dtype=dt)]
            g.reduce_scatter_tensor_coalesced(outs, [mine], rs_opts).wait()
            same("reduce_scatter_tensor_coalesced", outs[0], ref, slice(rank * k, (rank + 1) * k))
            for name, ok in results.items():
                checked += 1
                if not ok:
                    failures.append(f"{name} {dt} {'tensor' if as_tensor else 'number'} factor")
    return dict(failures=failures, checked=checked, **_refusals_then_close(g, world, {
        "int64": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0),
                                         group=g),
        "complex factor": lambda: dist.all_reduce(torch.ones(3), group=g,
                                                  op=dist._make_nccl_premul_sum(torch.tensor([1j]))),
    }))


def _coalesced(op) -> "dist.AllreduceCoalescedOptions":
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = op
    return opts


def ddp_bool_buffer(rank: int, world: int) -> List[torch.Tensor]:
    """DDP on a model with a bool buffer (a mask) that differs per rank: the
    constructor broadcasts it from rank 0; a step trains through it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = _group(world)
    if g is None:
        return []

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.register_buffer("mask", torch.arange(6) % (2 + rank) == 0)
            self.register_buffer("count", torch.tensor([rank], dtype=torch.int16))

        def forward(self, x):
            return self.lin(x) * self.mask

    torch.manual_seed(rank)
    ddp = DDP(Masked(), process_group=g)
    ddp(torch.randn(3, 6)).sum().backward()
    logged = ddp._get_ddp_logging_data().get("backend_name")
    result = [ddp.module.mask.clone(), ddp.module.count.clone(), ddp.module.lin.weight.grad.clone()]
    del ddp
    dist.destroy_process_group(g)
    return result + [logged]


def timeout_words(rank: int, world: int, per_call: bool = False) -> tuple:
    """Only rank 0 enters a barrier that may wait 1 s: the group's timeout, or
    (per_call) the barrier's own on a group whose timeout is 60 s.
    Returns (error, seconds rank 0 waited)."""
    group_timeout = 60 if per_call else 1
    g = dist.new_group(list(range(world)), backend="pycomm", timeout=datetime.timedelta(seconds=group_timeout))
    if rank >= world:
        return "", 0.0
    out, waited = "", 0.0
    if rank == 0:
        t0 = time.monotonic()
        try:
            if per_call:
                dist.barrier(group=g, timeout=datetime.timedelta(seconds=1))
            else:
                dist.barrier(group=g)
            out = "no error"
        except dist.DistBackendError as e:
            out = f"{type(e).__name__}: {e}"
        waited = time.monotonic() - t0
    else:
        time.sleep(2.5)  # alive, just late: a rank that left would be named as such
    dist.destroy_process_group(g)
    return out, waited


def mismatch(rank: int, world: int) -> str:
    """Rank 1 all-reduces one element more than the others."""
    g = _group(world)
    if g is None:
        return ""
    try:
        dist.all_reduce(torch.ones(10 + (rank == 1)), group=g)
        return "no error"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group(g)


def ddp_train(rank: int, world: int, backend: str, hook: Optional[str] = None, steps: int = 6) -> List[torch.Tensor]:
    """A few DDP steps of a small MLP on per-rank random data; returns the
    final parameters (equal on every rank when DDP works)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = _group(world, backend=backend)
    if g is None:
        return []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
    # Different initial weights per rank: DDP's broadcast from rank 0 must fix them.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)
    ddp = DDP(model, process_group=g, bucket_cap_mb=0.01)  # several buckets
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(g, default_hooks.allreduce_hook)
    elif hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(g, default_hooks.fp16_compress_hook)
    elif hook in ("pycomm", "pycomm-int8"):
        import pycomm
        from pycomm import hooks

        if hook == "pycomm":
            state = hooks.AllReduceState(g)
            ddp.register_comm_hook(state, hooks.allreduce_hook)
        else:
            state = hooks.CompressionState(g, pycomm.Int8(), start_iter=0)
            ddp.register_comm_hook(state, hooks.int8_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    del ddp
    if hook in ("pycomm", "pycomm-int8"):
        state.communicator.close()
    dist.destroy_process_group(g)
    return params
