"""1F1B (PipeDream-Flush, Narayanan et al., 2021): the same bubble as GPipe,
but a stage starts backward as soon as the last stage can, so it never holds
the activations of more than p - stage micro-batches (GPipe: all m).

1. Warm-up: stage s runs min(p - s - 1, m) forwards; these fill the pipe.
2. Steady state: one forward, then one backward, until every forward ran.
3. Cool-down: the remaining backwards.
"""
from __future__ import annotations

from typing import List

from .schedule import Action, check_args


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> List[Action]:
    """Actions of ``stage`` under 1F1B.

    Example::

        one_f_one_b(2, 3, 0)   # [F0, F1, B0, F2, B1, B2]
        one_f_one_b(2, 3, 1)   # [F0, B0, F1, B1, F2, B2]
    """
    check_args(num_stages, num_microbatches, stage)
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    actions = [Action("F", k) for k in range(warmup)]
    f, b = warmup, 0
    while f < m:
        actions += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    actions += [Action("B", k) for k in range(b, m)]
    return actions
