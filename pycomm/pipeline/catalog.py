"""The pipeline schedules by name, and where a schedule places the stages.

Example::

    from pycomm.pipeline import get_schedule, stages_of
    stages_of(get_schedule("zbv"), 4, 0)   # [0, 7]: rank 0 holds the V's two ends
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .schedule import Schedule, placement, plans
from .zero_bubble import interleaved_zero_bubble, zb_h1, zbv

# name -> (schedule, chunks per rank it takes: None for any v >= 1, else the only value)
SCHEDULES: Dict[str, Tuple[Callable[..., List[Any]], Optional[int]]] = {
    "gpipe": (gpipe, 1),
    "1f1b": (one_f_one_b, 1),
    "interleaved-1f1b": (interleaved_1f1b, None),
    "zb-h1": (zb_h1, 1),
    "interleaved-zb": (interleaved_zero_bubble, None),
    "zbv": (zbv, 2),
}


def get_schedule(schedule: Union[str, Schedule], virtual_stages: Optional[int] = None) -> Schedule:
    """The schedule function for a name of :data:`SCHEDULES` (with
    ``virtual_stages`` chunks per rank where the schedule takes it), or
    ``schedule`` itself when it is already a function.

    Example::

        get_schedule("interleaved-1f1b", virtual_stages=2)(4, 8, 0)   # rank 0's actions
    """
    if not isinstance(schedule, str):
        if virtual_stages not in (None, 1):
            raise ValueError("virtual_stages goes with a schedule name; a schedule function places its own stages")
        return schedule
    name = schedule.lower()
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)} or a function")
    fn, only = SCHEDULES[name]
    if only is not None:
        if virtual_stages not in (None, only):
            raise ValueError(f"schedule {name!r} runs {only} stage(s) per rank, not virtual_stages={virtual_stages}")
        return fn
    v = 2 if virtual_stages is None else virtual_stages
    if type(v) is not int or v < 1:
        raise ValueError(f"virtual_stages must be an int >= 1, got {virtual_stages!r}")
    return functools.partial(fn, virtual_stages=v)


def stages_of(schedule: Schedule, num_ranks: int, rank: int) -> List[int]:
    """The global stages ``rank`` holds under ``schedule`` (ascending).

    Example::

        stages_of(get_schedule("zbv"), 4, 0)   # [0, 7]: the V's two ends
    """
    return [s for s, r in enumerate(stage_placement(schedule, num_ranks)) if r == rank]


def stage_placement(schedule: Schedule, num_ranks: int) -> List[int]:
    # Where the stages are does not depend on the number of micro-batches.
    return placement(plans(schedule, num_ranks, 1))

