"""GPipe: every forward, then every backward (Huang et al., 2019).

Each stage holds the activations of all m micro-batches at once; the bubble
is (p-1)/(m+p-1) of the step.
"""
from __future__ import annotations

from typing import List

from .schedule import Action, check_args


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> List[Action]:
    """Actions of ``stage``: F0 .. F(m-1), then B0 .. B(m-1).

    Example::

        gpipe(2, 3, 0)   # [F0, F1, F2, B0, B1, B2]
    """
    check_args(num_stages, num_microbatches, stage)
    m = num_microbatches
    return [Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)]
