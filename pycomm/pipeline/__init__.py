"""A small pipeline-parallel runner over pycomm: GPipe, 1F1B, interleaved
1F1B and zero-bubble schedules (ZB-H1, interleaved, ZB-V).

Example::

    comm = pycomm.Communicator()                         # rank i runs stage i
    pipe = Pipeline.from_layers(layers, comm, num_microbatches=8, schedule="1f1b",
                                loss_fn=torch.nn.functional.cross_entropy)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
"""
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .catalog import SCHEDULES, get_schedule, stages_of
from .grid import grid
from .runner import Pipeline
from .schedule import (Action, Simulation, bubble_theory, list_schedule, placement, plans, simulate, validate,
                       zero_bubble_theory)
from .stage import StageModule, partition, stage_layers
from .zero_bubble import interleaved_zero_bubble, split_weights, zb_h1, zbv

__all__ = [
    "Action",
    "Pipeline",
    "SCHEDULES",
    "Simulation",
    "StageModule",
    "bubble_theory",
    "get_schedule",
    "gpipe",
    "grid",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "list_schedule",
    "one_f_one_b",
    "partition",
    "placement",
    "plans",
    "simulate",
    "split_weights",
    "stage_layers",
    "stages_of",
    "validate",
    "zb_h1",
    "zbv",
    "zero_bubble_theory",
]
