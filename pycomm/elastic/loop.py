"""What the fault-tolerant trainers share (:class:`~pycomm.elastic.FaultTolerantDDP`,
:class:`~pycomm.elastic.FaultTolerantPipeline`): training until every rank
agrees it is done, newcomers admitted at step boundaries (and waited for below
the job's minimum size), and the record of membership changes.

A trainer that mixes :class:`ElasticLoop` in keeps ``comm``, ``steps_done``,
``shrink_timeout``, ``events`` and ``_admit_checked``, calls
``_set_admission`` (when newcomers come in, and the job's size bounds), and
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
from .membership import _waiting, admit

logger = logging.getLogger("pycomm")


class ElasticLoop:
    """Mixin of the fault-tolerant trainers (see the module's docstring)."""

    #: Newcomers are admitted in groups of this many (a pipeline: whole replicas).
    _admit_multiple = 1
    #: How often members below min_world_size look for newcomers: each look is
    #: one Store operation and one all-reduce of two numbers.
    _REFILL_POLL_S = 0.1

    def _set_admission(self, who: str, admit_every: int, max_world_size: Optional[int],
                       min_world_size: Optional[int], min_world_timeout: float) -> None:
        """Check and keep when newcomers come in (every ``admit_every``
        steps; 0: never), how far they may grow the job, and below what size
        the members stop and wait for them (for at most ``min_world_timeout`` s)."""
        if int(admit_every) < 0:
            raise ValueError(f"pycomm.elastic.{who}: admit_every must be >= 0, got {admit_every}")
        if max_world_size is not None and int(max_world_size) < self._admit_multiple:
            raise ValueError(f"pycomm.elastic.{who}: max_world_size must be >= {self._admit_multiple} (or None: no "
                             f"bound), got {max_world_size}")
        if min_world_size is not None and not 1 <= int(min_world_size) <= (max_world_size or int(min_world_size)):
            raise ValueError(f"pycomm.elastic.{who}: min_world_size must be >= 1 and <= max_world_size "
                             f"({max_world_size}), got {min_world_size}")
        if not float(min_world_timeout) >= 0:
            raise ValueError(f"pycomm.elastic.{who}: min_world_timeout must be >= 0, got {min_world_timeout}")
        self.admit_every = int(admit_every)
        self.max_world_size = None if max_world_size is None else int(max_world_size)
        self.min_world_size = None if min_world_size is None else int(min_world_size)
        self.min_world_timeout = float(min_world_timeout)

    def _refill(self) -> None:
        """Below ``min_world_size`` (torchrun's minimum of ``--nnodes``):
        stop at this step boundary and admit newcomers as they come, until
        the job has its minimum again; if it has not within
        ``min_world_timeout`` seconds, every member raises CommError.
        Collective over the members; a failure meanwhile is recovered from
        (the wait goes on with the survivors)."""
        if not self._below_min():
            return
        t0 = time.monotonic()
        logger.warning("pycomm.elastic: %s, below min_world_size=%d: waiting up to %g s for newcomers at step %d",
                       self._world_text(), self.min_world_size, self.min_world_timeout, self.steps_done)
        while self._below_min():
            t1 = time.monotonic()
            try:
                # 1. Agree on what the members saw: enough tickets for an
                #    admission, or a wait that is over (a member's clock
                #    ran out). Every member then does the same: admit
                #    calls stay in lockstep, and idle looks write nothing
                #    to the Store.
                seen = torch.tensor([_waiting(self.comm), int(t1 - t0 >= self.min_world_timeout)], dtype=torch.int64)
                self.comm.all_reduce(seen, op="max")
                tickets, late = seen.tolist()
                # 2. Admit (and heal) the newcomers there is room for.
                if tickets >= self._admit_multiple and self._admit_and_heal(t1):
                    continue
            except CommError as e:
                self._recover(e)
                continue
            # 3. Give up together, or look again.
            if late:
                raise CommError(f"pycomm.elastic: the job has {self.comm.world_size} ranks, fewer than "
                                f"min_world_size={self.min_world_size}, and not enough newcomers came within "
                                f"{self.min_world_timeout:g} s; restart it from a checkpoint (state_dict())")
            time.sleep(self._REFILL_POLL_S)

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
        if self._below_min():
            self._refill()
            return
        if not self.admit_every or self.steps_done % self.admit_every or self.steps_done == self._admit_checked:
            return
        self._admit_checked = self.steps_done
        try:
            self._admit_and_heal(time.monotonic())
        except CommError as e:
            self._recover(e)

    def _admit_and_heal(self, t0: float) -> bool:
        """Admit the newcomers waiting in :func:`~pycomm.elastic.join` that
        there is room for, heal them and record it (an admission that began
        at ``t0``). Collective over the members; whether anyone came in.
        Raises CommError (a member or newcomer lost meanwhile)."""
        new = admit(self.comm, timeout=self.shrink_timeout, multiple=self._admit_multiple,
                    max_world_size=self.max_world_size)
        if new is self.comm:
            return False
        self._bind(new)
        self._heal()
        self._event("admit", t0)
        return True

    def _below_min(self) -> bool:
        """Whether the job has fewer ranks than its ``min_world_size``."""
        return self.min_world_size is not None and self.comm.world_size < self.min_world_size

    def _adopt(self, comm: Communicator) -> None:
        """Take a new membership's communicator and heal (what a shrink hands over)."""
        self._bind(comm)
        self._heal()

    def _world_text(self) -> str:
        """The membership as the log says it."""
        return f"world {self.comm.world_size}"

    def _event(self, kind: str, t0: float, cause: str = "", **extra: Any) -> None:
        """Record (``events``) and log a membership change that began at
        ``t0`` (``extra``: what else the trainer says of it)."""
        seconds = time.monotonic() - t0
        self.events.append(dict(kind=kind, step=self.steps_done, world=self.comm.world_size, epoch=self.comm.epoch,
                                seconds=seconds, **(dict(cause=cause) if cause else {}), **extra))
        logger.info("pycomm.elastic: %s: %s, epoch %d, step %d (%.3f s)", kind, self._world_text(), self.comm.epoch,
                    self.steps_done, seconds)
