"""What the fault-tolerant trainers share (:class:`~pycomm.elastic.FaultTolerantDDP`,
:class:`~pycomm.elastic.FaultTolerantPipeline`): training until every rank
agrees it is done, newcomers admitted at step boundaries, and the record of
membership changes.

A trainer that mixes :class:`ElasticLoop` in keeps ``comm``, ``steps_done``,
``admit_every``, ``max_world_size`` (both set by ``_set_admission``),
``shrink_timeout``, ``events`` and ``_admit_checked``, and
provides ``_bind(comm)`` (take a new membership's communicator), ``_heal()``
(every rank takes the most advanced rank's state; collective) and
``_recover(error)`` (shrink to the survivors and heal).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from .._loader import CommError
from ..communicator import Communicator
from .membership import admit

logger = logging.getLogger("pycomm")


class ElasticLoop:
    """Mixin of the fault-tolerant trainers (see the module's docstring)."""

    #: Newcomers are admitted in groups of this many (a pipeline: whole replicas).
    _admit_multiple = 1

    def _set_admission(self, who: str, admit_every: int, max_world_size: Optional[int]) -> None:
        """Check and keep when newcomers come in (every ``admit_every``
        steps; 0: never) and how far they may grow the job."""
        if int(admit_every) < 0:
            raise ValueError(f"pycomm.elastic.{who}: admit_every must be >= 0, got {admit_every}")
        if max_world_size is not None and int(max_world_size) < self._admit_multiple:
            raise ValueError(f"pycomm.elastic.{who}: max_world_size must be >= {self._admit_multiple} (or None: no "
                             f"bound), got {max_world_size}")
        self.admit_every = int(admit_every)
        self.max_world_size = None if max_world_size is None else int(max_world_size)

    def _train_until(self, steps: int, step: Callable[[], Any]) -> None:
        """Call ``step()`` until ``steps`` steps are done on every rank,
        surviving failures. A survivor may have finished the last step while
        another failed it: all agree on the count before anyone leaves."""
        while True:
            while self.steps_done < steps:
                step()
            try:
                count = torch.tensor([self.steps_done], dtype=torch.int64)
                self.comm.all_reduce(count, op="min")
                if int(count) >= steps:
                    return
            except CommError as e:
                self._recover(e)

    def _maybe_admit(self) -> None:
        """At a step boundary, every ``admit_every`` steps (once per step
        count): admit the newcomers waiting in :func:`~pycomm.elastic.join`
        and heal them. Collective over the members."""
        if not self.admit_every or self.steps_done % self.admit_every or self.steps_done == self._admit_checked:
            return
        self._admit_checked = self.steps_done
        t0 = time.monotonic()
        try:
            new = admit(self.comm, timeout=self.shrink_timeout, multiple=self._admit_multiple,
                        max_world_size=self.max_world_size)
            if new is self.comm:
                return
            self._bind(new)
            self._heal()
        except CommError as e:
            self._recover(e)
            return
        self._event("admit", t0)

    def _adopt(self, comm: Communicator) -> None:
        """Take a new membership's communicator and heal (what a shrink hands over)."""
        self._bind(comm)
        self._heal()

    def _world_text(self) -> str:
        """The membership as the log says it."""
        return f"world {self.comm.world_size}"

    def _event(self, kind: str, t0: float, cause: str = "") -> None:
        """Record (``events``) and log a membership change that began at ``t0``."""
        seconds = time.monotonic() - t0
        self.events.append(dict(kind=kind, step=self.steps_done, world=self.comm.world_size, epoch=self.comm.epoch,
                                seconds=seconds, **(dict(cause=cause) if cause else {})))
        logger.info("pycomm.elastic: %s: %s, epoch %d, step %d (%.3f s)", kind, self._world_text(), self.comm.epoch,
                    self.steps_done, seconds)
