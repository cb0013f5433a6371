"""Worker-side case for pycomm as a torch.distributed backend: tensors that
are not contiguous in every single-tensor collective (run inside harness
workers that joined c10d_cases' default group)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from c10d_cases import _group
from collective_cases import make_input


def layouts(rank: int, world: int) -> Dict[str, object]:
    """Tensors that are not contiguous, in every collective that takes one
    tensor: a transposed view, channels_last, every other element of a
    buffer (whose gaps must stay untouched), and layouts that differ between
    ranks (Gloo sums such tensors' memory element by element: wrong values).
    Integer data, so every expected value is exact. Returns what each check
    found, and the error of an output whose elements share memory."""
    g = _group(world)
    out: Dict[str, object] = {}
    if g is None:
        return out
    seed = 777

    def data(r: int, n: int, salt: int = 0) -> torch.Tensor:
        return make_input(seed + salt, r, n, torch.int64)

    def strided(values: torch.Tensor) -> tuple:  # a view of every other element, and its buffer
        buf = torch.full((2 * values.numel(),), -7, dtype=values.dtype)
        view = buf[::2]
        view.copy_(values)
        return view, buf

    def transposed(values: torch.Tensor, rows: int) -> torch.Tensor:  # shape (rows, n / rows), column-major
        t = torch.empty(values.numel() // rows, rows, dtype=values.dtype).t()
        t.copy_(values.view(rows, -1))
        return t

    total = sum(data(r, 24) for r in range(world))
    # all_reduce: transposed (async, through the future), channels_last,
    # strided, and one layout per rank.
    t = transposed(data(rank, 24), 4)
    res = dist.all_reduce(t, group=g, async_op=True).get_future().wait()[0]
    out["all_reduce transposed"] = torch.equal(t, total.view(4, 6)) and res is t and t.stride() == (1, 4)
    cl = data(rank, 24).view(1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
    dist.all_reduce(cl, group=g)
    out["all_reduce channels_last"] = (torch.equal(cl, total.view(1, 2, 3, 4))
                                       and cl.is_contiguous(memory_format=torch.channels_last))
    view, buf = strided(data(rank, 24))
    dist.all_reduce(view, group=g)
    out["all_reduce strided"] = torch.equal(view, total) and bool((buf[1::2] == -7).all())
    mixed = transposed(data(rank, 24), 4) if rank % 2 else data(rank, 24).view(4, 6).clone()
    dist.all_reduce(mixed, group=g)
    out["all_reduce mixed layouts"] = torch.equal(mixed, total.view(4, 6))

    # broadcast and reduce: the root's tensor / the sum land in a strided view.
    root = world - 1
    view, buf = strided(data(rank, 24))
    dist.broadcast(view, src=root, group=g)
    out["broadcast strided"] = torch.equal(view, data(root, 24)) and bool((buf[1::2] == -7).all())
    t = transposed(data(rank, 24), 3)
    dist.reduce(t, dst=root, group=g)
    out["reduce transposed"] = torch.equal(t, (total if rank == root else data(rank, 24)).view(3, 8))

    # Gathers: transposed inputs; all_gather_into_tensor strided both ways.
    t = transposed(data(rank, 24), 2)
    outs = [torch.empty(2, 12, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, t, group=g)
    out["all_gather transposed input"] = all(torch.equal(o, data(r, 24).view(2, 12)) for r, o in enumerate(outs))
    view, buf = strided(torch.zeros(24 * world, dtype=torch.int64))
    dist.all_gather_into_tensor(view, strided(data(rank, 24))[0], group=g)
    want = torch.cat([data(r, 24) for r in range(world)])
    out["all_gather_into_tensor strided"] = torch.equal(view, want) and bool((buf[1::2] == -7).all())
    outs = [torch.empty(2, 12, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(transposed(data(rank, 24), 2), outs, dst=0, group=g)
    out["gather transposed input"] = rank != 0 or all(torch.equal(o, data(r, 24).view(2, 12))
                                                      for r, o in enumerate(outs))

    # reduce_scatter_tensor: a transposed input (world x 6, column-major), a
    # strided output; all_to_all_single: strided both ways.
    whole = transposed(data(rank, 6 * world, 1), world)
    view, buf = strided(torch.zeros(6, dtype=torch.int64))
    dist.reduce_scatter_tensor(view, whole, group=g)
    want = sum(data(r, 6 * world, 1) for r in range(world)).view(world, 6)[rank]
    out["reduce_scatter_tensor transposed in, strided out"] = (torch.equal(view, want)
                                                               and bool((buf[1::2] == -7).all()))
    src, _ = strided(data(rank, 3 * world, 2))
    dst, buf = strided(torch.zeros(3 * world, dtype=torch.int64))
    dist.all_to_all_single(dst, src, group=g)
    want = torch.cat([data(r, 3 * world, 2).view(world, 3)[rank] for r in range(world)])
    out["all_to_all_single strided"] = torch.equal(dst, want) and bool((buf[1::2] == -7).all())

    # Outputs that overlap their inputs: the input is read whole first (Gloo
    # writes as it goes: its in-place all_to_all_single came out wrong on a
    # rank). In place all-to-all; a reduce-scatter's output half a block off
    # its own block; an all-gather's input in another rank's block.
    x = data(rank, 3 * world, 3).clone()
    dist.all_to_all_single(x, x, group=g)
    want = torch.cat([data(r, 3 * world, 3).view(world, 3)[rank] for r in range(world)])
    out["all_to_all_single in place"] = torch.equal(x, want)
    x = data(rank, 4 * world, 4).clone()
    at = (rank * 4 + 2) % (4 * world - 3)  # 4 elements from here, never this rank's block
    dist.reduce_scatter_tensor(x[at:at + 4], x, group=g)
    want = sum(data(r, 4 * world, 4) for r in range(world)).view(world, 4)[rank]
    rest = torch.ones(4 * world, dtype=torch.bool)
    rest[at:at + 4] = False
    out["reduce_scatter_tensor output off its block"] = (torch.equal(x[at:at + 4], want)
                                                         and torch.equal(x[rest], data(rank, 4 * world, 4)[rest]))
    y = torch.zeros(5 * world, dtype=torch.int64)
    other = (rank + 1) % world  # the input sits in the next rank's block of the output
    y[other * 5:(other + 1) * 5] = data(rank, 5, 5)
    dist.all_gather_into_tensor(y, y[other * 5:(other + 1) * 5], group=g)
    out["all_gather_into_tensor input in another block"] = torch.equal(y, torch.cat([data(r, 5, 5)
                                                                                      for r in range(world)]))

    # An output whose elements share memory cannot hold a result: refused on
    # every rank, in turn, and the group goes on.
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.int64).expand(5), group=g)
        out["expanded output"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is part of what is checked
        out["expanded output"] = f"{type(e).__name__}: {e}"
    t = data(rank, 24).clone()
    dist.all_reduce(t, group=g)
    out["after the refusal"] = torch.equal(t, total)
    return out
