"""A small pipeline-parallel runner over pycomm: GPipe and 1F1B.

Example::

    comm = pycomm.Communicator()                         # rank i runs stage i
    pipe = Pipeline.from_layers(layers, comm, num_microbatches=8, schedule="1f1b",
                                loss_fn=torch.nn.functional.cross_entropy)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
"""
from .gpipe import gpipe
from .one_f_one_b import one_f_one_b
from .runner import SCHEDULES, Pipeline, grid
from .schedule import Action, Simulation, bubble_theory, simulate, validate
from .stage import StageModule, partition, stage_layers

__all__ = [
    "Action",
    "Pipeline",
    "SCHEDULES",
    "Simulation",
    "StageModule",
    "bubble_theory",
    "gpipe",
    "grid",
    "one_f_one_b",
    "partition",
    "simulate",
    "stage_layers",
    "validate",
]
