"""Training that survives failures.

* :mod:`pycomm.elastic.membership` — a communicator's members change:
  :func:`shrink` to the survivors after a failure (or leaving ranks out on
  purpose), :func:`admit` / :func:`join` to grow by newcomers; every change
  makes a new communicator of the next membership epoch and fences the old.
* :mod:`pycomm.elastic.ddp` — :class:`FaultTolerantDDP`: DDP training that
  shrinks, heals and goes on when a rank dies, and heals a replacement.
* :mod:`pycomm.elastic.pipeline` — :class:`FaultTolerantPipeline`: pipeline x
  data-parallel training that regroups the survivors of broken replicas
  into whole ones, goes on while every stage's state survives on one rank,
  and admits whole replacement replicas.
* :mod:`pycomm.elastic.epoch_group` — the process group of one membership
  epoch, for CUDA models (NCCL) and the group path (Gloo).
* :mod:`pycomm.elastic.loop` — what both trainers share: train until every
  rank agrees it is done, admit newcomers at step boundaries (within the
  job's size bounds, waiting for them below its minimum), record changes.
"""
from .membership import FencedOut, StateLost, admit, join, shrink
from .ddp import FaultTolerantDDP
from .pipeline import FaultTolerantPipeline

__all__ = ["FaultTolerantDDP", "FaultTolerantPipeline", "FencedOut", "StateLost", "admit", "join", "shrink"]
