"""Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): each rank holds v
model chunks, stages r, r + p, ..., r + (v-1)p of p*v, so a micro-batch
loops v times through the ranks. A rank's forward of one chunk is 1/v of
its work, so the pipe fills and drains v times faster: the bubble falls to
(p-1)/(v*m+p-1), at the cost of v times more messages.

1. Forward order: micro-batches in groups of p (the last group may be
   smaller); within a group, chunk 0 of every micro-batch, then chunk 1, ...
   Backward order: the same with the chunks reversed.
2. Warm-up: 2(p-r-1) + (v-1)g forwards (g: the first group's size), which
   fill the loop and keep the last stage busy.
3. Steady state: one forward, one backward; then the remaining backwards.

That order assumes p divides m (Megatron requires it). Otherwise a rank can
wait for a forward that its predecessor runs only after a backward that
waits for it, so for other m the order comes from the list scheduler
(:func:`schedule.list_schedule`) with one chunk more of memory: always
correct, with a bubble up to ~1.4x (p-1)/(v*m+p-1).
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence, Tuple

from .schedule import Action, check_args, list_schedule, simulate


def _order(num_ranks: int, num_microbatches: int, chunks: Sequence) -> List[Tuple[int, int]]:
    p, m = num_ranks, num_microbatches
    out = []
    for g in range(0, m, p):
        group = range(g, min(g + p, m))
        for c in chunks:
            out += [(k, c) for k in group]
    return out


def _warmup(p: int, m: int, v: int, rank: int) -> int:
    return min(m * v, 2 * (p - rank - 1) + (v - 1) * min(p, m))


@lru_cache(maxsize=256)
def _listed(p: int, m: int, v: int) -> Tuple[Tuple[Action, ...], ...]:
    owner = [s % p for s in range(p * v)]
    best = None
    # A little more memory than Megatron's limit, earliest or deepest work
    # first: the variant with the shortest step (on p = 2..4, m = 2..10 it
    # comes within ~1.4x of (p-1)/(vm+p-1)).
    for extra in (2, 3):
        for deeper in (False, True):
            limit = [_warmup(p, m, v, r) + extra for r in range(p)]
            try:
                out = list_schedule(p, m, owner, split=False, limit=limit, window=p, prefer_deeper=deeper)
            except ValueError:
                continue
            span = simulate(lambda _p, _m, r: out[r], p, m).makespan
            if best is None or span < best[0]:
                best = (span, out)
    if best is None:
        raise ValueError(f"interleaved_1f1b: no order found for p={p}, m={m}, v={v}")
    return tuple(map(tuple, best[1]))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, rank: int, virtual_stages: int = 2) -> List[Action]:
    """Actions of ``rank`` under interleaved 1F1B with ``virtual_stages`` chunks per rank.

    Example::

        interleaved_1f1b(2, 2, 0)   # [F0@0, F1@0, F0@2, F1@2, B0@2, B1@2, B0@0, B1@0]
    """
    check_args(num_ranks, num_microbatches, rank)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if m % p:
        return list(_listed(p, m, v)[rank])
    fwd = _order(p, m, range(v))
    bwd = _order(p, m, range(v - 1, -1, -1))
    total = m * v
    warmup = _warmup(p, m, v, rank)
    actions = [Action("F", k, c * p + rank) for k, c in fwd[:warmup]]
    f, b = warmup, 0
    while f < total:
        k, c = fwd[f]
        actions.append(Action("F", k, c * p + rank))
        k, c = bwd[b]
        actions.append(Action("B", k, c * p + rank))
        f, b = f + 1, b + 1
    actions += [Action("B", k, c * p + rank) for k, c in bwd[b:]]
    return actions
