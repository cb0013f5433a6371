"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024): the backward of a stage is split into B, the gradient of its
inputs, which the previous stage waits for, and W, the gradient of its
weights, which nobody waits for. B runs where 1F1B's backward ran; W runs
later, where the stage would otherwise idle.

- ``zb_h1``: 1F1B's order with each W delayed by ``rank`` micro-batches
  (rank r runs W of micro-batch k after B of k + r). Rank r then holds at
  most p micro-batches (p - r waiting for B, up to r waiting for W): the
  pipeline's peak is 1F1B's (rank 0's p). Each rank idles (p-1)(F+B-W) of
  the step, a third of 1F1B's idle time when F = B = W
  (:func:`schedule.zero_bubble_theory`).
- ``interleaved_zero_bubble``: the same on interleaved 1F1B's order (v
  looped chunks per rank; torch's ``ScheduleInterleavedZeroBubble``): idle
  (p-1)(F+B-W) with per-chunk times.
- ``zbv``: two chunks per rank in a V (rank r holds stages r and 2p-1-r, so
  the first and the last stage share rank 0 and the turn at rank p-1 needs
  no message), at most 2p chunk activations per rank (1F1B's peak: a chunk
  is half a stage); the order comes from :func:`schedule.list_schedule`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence, Tuple

from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .schedule import Action, check_args, list_schedule


def split_weights(actions: Sequence[Action], delay: int) -> List[Action]:
    """``actions`` with every backward split into B and W, each W placed
    after the B that comes ``delay`` backwards later (the rest at the end).

    Example::

        split_weights([Action("F", 0), Action("B", 0)], 0)   # [F0, B0, W0]
    """
    out: List[Action] = []
    pending: List[Action] = []
    for a in actions:
        out.append(a)
        if a.op == "B":
            pending.append(a)
            if len(pending) > delay:
                b = pending.pop(0)
                out.append(Action("W", b.microbatch, b.stage))
    return out + [Action("W", b.microbatch, b.stage) for b in pending]


def zb_h1(num_ranks: int, num_microbatches: int, rank: int) -> List[Action]:
    """Actions of ``rank`` under ZB-H1.

    Example::

        zb_h1(2, 2, 0)   # [F0, F1, B0, W0, B1, W1]
    """
    return split_weights(one_f_one_b(num_ranks, num_microbatches, rank), rank)


def interleaved_zero_bubble(num_ranks: int, num_microbatches: int, rank: int,
                            virtual_stages: int = 2) -> List[Action]:
    """Actions of ``rank`` with ``virtual_stages`` looped chunks, B and W split."""
    return split_weights(interleaved_1f1b(num_ranks, num_microbatches, rank, virtual_stages), rank)


@lru_cache(maxsize=256)
def _zbv_plans(p: int, m: int) -> Tuple[Tuple[Action, ...], ...]:
    owner = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return tuple(map(tuple, list_schedule(p, m, owner, split=True, limit=[2 * p] * p)))


def zbv(num_ranks: int, num_microbatches: int, rank: int) -> List[Action]:
    """Actions of ``rank`` under ZB-V (two chunks per rank, V-shaped).

    Example::

        zbv(1, 1, 0)   # [F0@0, F0@1, B0@1, B0@0, W0@1, W0@0] (in the order the list scheduler picks)
    """
    check_args(num_ranks, num_microbatches, rank)
    return list(_zbv_plans(num_ranks, num_microbatches)[rank])
