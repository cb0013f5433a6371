"""Fault-tolerant data-parallel training: when a rank dies the survivors shrink,
heal and go on; a replacement that joins is healed before its first step.

:class:`FaultTolerantDDP` wraps a model and its optimizer. It runs torch's
``DistributedDataParallel`` for the bucketing and the overlap of backward with
communication, on a private one-rank process group (so DDP itself never waits
on a peer), and sends every bucket through a pycomm hook on a pycomm
communicator it can replace: a process group's membership is fixed, a pycomm
communicator's is not. CUDA models (and CPU ones with ``path="group"``) take
the group path instead: a fresh NCCL (Gloo) group per membership epoch, built
over the epoch communicator's Store keys and watched through it
(:mod:`pycomm.elastic.epoch_group`); membership, heal and fencing stay the
communicator's.

A step (:meth:`FaultTolerantDDP.step`):

1. At a step boundary, every ``admit_every`` steps, newcomers waiting in
   :func:`pycomm.elastic.join` are admitted and healed.
2. The closure runs forward and backward; each bucket goes through the hook.
   A failed bucket is handed back to DDP untouched and remembered, so that
   DDP's own state stays whole.
3. No failure: the optimizer steps and ``steps_done`` grows by one.
4. A failure: the survivors :func:`~pycomm.elastic.shrink` (retried while
   further ranks die), rebind the hook to the new communicator (averages are
   rescaled to the new world by the communicator's ``avg``) and heal: the
   rank that completed the most steps sends the model, the optimizer and
   ``extra_state`` to every rank that is behind. Then the step is redone with
   the survivors (``on_failure="redo"``, the default: a step is never lost,
   only the dead rank's share of its batch) or skipped (``"drop"``). If a
   survivor had already completed it (it can finish before another notices
   the death), everyone adopts its result instead.

What the heal sends and what it does not: parameters, buffers, optimizer
state, the step count and the hook's iteration count always; the
error-feedback residuals of the compressed hooks are this rank's own
compression error (the part of its gradients it still owes), so a newcomer
starts with zero residuals instead of a copy of a peer's, which would send
that peer's error twice; after a change of world every rank keeps its worker
residual and restarts its server residual, whose shard moved. With
:func:`~pycomm.hooks.stale_hook` the averages in flight at a change are
dropped on every rank (at most ``staleness`` steps of gradients).

Example (every rank; a replacement runs the same script with ``--join``)::

    store = dist.TCPStore(store_host, port, is_master=False)     # outlives every rank
    if joining:
        comm = pycomm.elastic.join(store, "train")
    else:
        comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name="train")
    ft = pycomm.elastic.FaultTolerantDDP(model, opt, comm, hook=hooks.int8_hook,
                                         state=hooks.CompressionState(start_iter=10))

    def train_step(step):                     # this rank's share of step `step`
        x, y = shard(step, ft.rank, ft.world_size)
        loss = loss_fn(ft(x), y)
        loss.backward()
        return loss.item()

    ft.train(1000, train_step)                # or: while ft.steps_done < n: ft.step(lambda: ...)
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import hooks as _hooks
from .._loader import CommError
from ..communicator import Communicator
from ..hooks.futures import GroupFutures
from .epoch_group import EpochGroup
from .heal import broadcast_state
from .loop import ElasticLoop
from .membership import StateLost, shrink_and_adopt

logger = logging.getLogger("pycomm")

ON_FAILURE = ("redo", "drop")


def _local_group() -> "dist.ProcessGroup":
    """A one-rank Gloo process group on a private store: DDP's own collectives
    (its bucket rebuild, buffer syncs) become local copies."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    # On loopback: Gloo's default device resolves the host's name, which
    # can stall on a machine without name service; this group never talks.
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = dist.ProcessGroupGloo(store, 0, 1, opts)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():  # a CUDA model's module-state sync, a copy onto itself
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _is_comm_failure(e: BaseException) -> bool:
    # A Work's future hands its CommError on as a RuntimeError with the same text.
    return isinstance(e, CommError) or "pycomm" in str(e)


class FaultTolerantDDP(torch.nn.Module, ElasticLoop):
    """Data-parallel training that survives the death of ranks and admits
    replacements (see :mod:`pycomm.elastic.ddp` for what a step does).

    Args:
        module: the model, on the CPU or on one GPU. A CUDA model's buckets
            take the group path: a process group per membership epoch
            (NCCL), built by the members when the membership changes (see
            :mod:`pycomm.elastic.epoch_group`); a CPU model's go through the
            communicator, or over a Gloo group per epoch when the state says
            ``path="group"``.
        optimizer: its optimizer (:class:`pycomm.hooks.LocalSGD` too).
        comm: a :class:`pycomm.Communicator` built on a Store that outlives
            every rank, or one from :func:`pycomm.elastic.join`. Building
            the wrapper is collective: it sends rank 0's model and optimizer
            state to every rank (a joining process: the most advanced
            member's).
        hook, state: any pycomm hook and its state (default:
            :func:`pycomm.hooks.allreduce_hook` with a fresh
            :class:`~pycomm.hooks.AllReduceState`). The state is bound to
            ``comm``, and to each communicator that replaces it.
        on_failure: ``"redo"`` the failed step with the survivors (default)
            or ``"drop"`` it.
        admit_every: admit waiting newcomers every this many steps (0: never;
            each check is two Store operations).
        max_world_size: never grow past this many ranks (None: no bound);
            newcomers beyond it wait in ``join`` as spares until a failure
            makes room (see :func:`~pycomm.elastic.admit`).
        min_world_size, min_world_timeout: never train with fewer than this
            many ranks (None: go on with any survivors). Below it (after a
            shrink) the members stop at the step boundary and admit
            newcomers as they come, a spare at once; if the job is not back
            to its minimum within ``min_world_timeout`` seconds, every rank
            raises CommError (restart from a checkpoint). torchrun's
            ``--nnodes=MIN:MAX`` with these two.
        scheduler: a learning-rate scheduler, stepped after each completed
            optimizer step (so that it counts the steps the ranks agree on)
            and healed with the model.
        extra_state: anything else with ``state_dict()`` /
            ``load_state_dict()`` that must match on every rank: healed with
            the model.
        grad_scaler: a ``torch.amp.GradScaler`` for float16 training. The
            closure scales the loss (``ft.grad_scaler.scale(loss).backward()``)
            and each step ends with ``grad_scaler.step(optimizer)`` and
            ``update()`` in place of ``optimizer.step()``; overflows are seen
            alike on every rank (DDP averages the scaled gradients). Its scale
            is healed with the model: gradients are averaged before they are
            unscaled, so every rank, a replacement too, must scale alike.
        shrink_timeout, grace: passed to :func:`~pycomm.elastic.shrink`.
        max_recoveries: raise after this many failed shrinks in one step's
            recovery (one that failed because a further peer was lost
            meanwhile counts a quarter: see ``membership.attempt_cost``).
        **ddp_kwargs: for ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``static_graph``, ...).

    Attributes: ``comm`` (the current communicator), ``steps_done``,
    ``events`` (one dict per membership change: step, kind, world, seconds; a
    shrink's ``cause`` is the first line of the failure that started it).
    """

    def __init__(self, module: torch.nn.Module, optimizer: Any, comm: Communicator, *,
                 hook: Optional[Callable] = None, state: Optional[_hooks.HookState] = None,
                 on_failure: str = "redo", admit_every: int = 10, max_world_size: Optional[int] = None,
                 min_world_size: Optional[int] = None, min_world_timeout: float = 600.0,
                 scheduler: Any = None, extra_state: Any = None,
                 grad_scaler: Any = None, shrink_timeout: float = 30.0, grace: float = 2.0,
                 max_recoveries: int = 8, **ddp_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(comm, Communicator):
            raise TypeError(f"pycomm.elastic.FaultTolerantDDP: comm must be a pycomm.Communicator, got "
                            f"{type(comm).__name__}")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"pycomm.elastic.FaultTolerantDDP: on_failure={on_failure!r}; use 'redo' or 'drop'")
        self._set_admission("FaultTolerantDDP", admit_every, max_world_size, min_world_size, min_world_timeout)
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ValueError(f"pycomm.elastic.FaultTolerantDDP: the model has parameters on "
                             f"{sorted(map(str, devices))}; it takes a model on the CPU or on one GPU")
        device = next(iter(devices))
        if hook is None:
            hook = _hooks.allreduce_hook
        if state is None:
            state = _hooks.AllReduceState()
        if not isinstance(state, _hooks.HookState):
            raise TypeError(f"pycomm.elastic.FaultTolerantDDP: state must be a pycomm hook state, got "
                            f"{type(state).__name__}")
        states = [st for st in (state, getattr(state, "inner", None)) if st is not None]
        # The group path: one process group per membership epoch (CUDA models
        # always: the communicator takes CPU tensors; CPU models on request).
        self._group_device: Optional[torch.device] = None
        if any(st.path == "ipc" for st in states):
            raise ValueError("pycomm.elastic.FaultTolerantDDP: path='ipc' cannot follow a change of membership "
                             "(an IPC group's ranks are fixed); a CUDA model takes the group path (path='auto')")
        if device.type == "cuda" and any(st.path == "communicator" for st in states):
            raise ValueError("pycomm.elastic.FaultTolerantDDP: path='communicator' takes CPU tensors; a CUDA "
                             "model's buckets take the group path (path='auto' or 'group')")
        if device.type == "cuda" or any(st.path == "group" for st in states):
            self._group_device = device
            for st in states:
                st.path = "group"
        self._epoch = None
        self.optimizer = optimizer
        self.hook, self.state = hook, state
        self.on_failure = on_failure
        self.scheduler, self.extra_state, self.grad_scaler = scheduler, extra_state, grad_scaler
        self.shrink_timeout, self.grace, self.max_recoveries = float(shrink_timeout), float(grace), int(max_recoveries)
        self.steps_done = 0
        self.events: List[Dict[str, Any]] = []
        self._failures: List[BaseException] = []
        self._dirty = False        # the optimizer stepped but its own collective failed (LocalSGD)
        self._admit_checked = -1   # steps_done at the last admit check
        # A newcomer's DDP still has the initial bucket layout; the members
        # rebuilt theirs after their first backward (in gradient-ready
        # order). Its first step is rehearsed without communication, so it
        # rebuilds the same layout before any bucket goes out.
        self._rehearse = comm.joined
        self._bypass = False
        with warnings.catch_warnings():
            # Buffers are this wrapper's to sync (the heal), never DDP's: it
            # has no peers. torch 2.13 deprecates the argument's name only.
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DistributedDataParallel(module, process_group=_local_group(), broadcast_buffers=False,
                                               **ddp_kwargs)
        self.ddp.register_comm_hook(None, self._hook)
        # Until its first heal completes, a rank is healed from the others
        # whatever they say (force), and a newcomer is never their source.
        self._first_heal = dict(force=True, newcomer=comm.joined)
        try:
            self._bind(comm)
            self._heal()
        except CommError as e:  # a peer died while this rank was being set up: shrink with the others
            self._recover(e)

    # -------------------------------------------------------------- public

    @property
    def module(self) -> torch.nn.Module:  # type: ignore[override]
        return self.ddp.module

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def group(self) -> Optional[EpochGroup]:
        """The current epoch's process group on the group path (its ``pg``,
        ``cuda_backend``), or None on the communicator path."""
        return self._epoch

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def step(self, closure: Callable[[], Any]) -> Any:
        """One training step: zero the gradients, run ``closure`` (forward and
        backward), average, step the optimizer.

        Returns the closure's value, or None when the step was dropped or
        adopted from a survivor that had completed it. A failure of a peer
        is recovered from inside (see the module's docstring); a rank that
        was fenced out raises :class:`pycomm.elastic.FencedOut`.
        """
        self._maybe_admit()
        if self._rehearse:
            self._rehearsal(closure)
        recoveries = 0
        while True:
            attempt = self.steps_done
            iteration = self.state.iteration
            self._failures = []
            self.optimizer.zero_grad()
            try:
                with self._watching():
                    value = closure()
            except Exception as e:  # noqa: BLE001 - sorted below
                if not (self._failures or _is_comm_failure(e)):
                    raise
                self._failures.append(e)
            if self._failures and self._epoch is not None:
                self._epoch.fail(str(self._failures[0]))
            if not self._failures:
                try:
                    self._optimizer_step()
                except Exception as e:  # LocalSGD's average: the local step is applied
                    if not _is_comm_failure(e):
                        raise
                    self._failures.append(e)
                    self._dirty = True
                self.steps_done += 1
                if self.scheduler is not None:
                    self.scheduler.step()
                if not self._failures:
                    return value
            recoveries += 1
            if recoveries > self.max_recoveries:
                raise CommError(f"pycomm.elastic: step {attempt} failed {recoveries} times; last failure: "
                                f"{self._failures[0]}")
            # Every rank counts the failed attempt's buckets alike: none of them.
            self.state.iteration = iteration
            self._recover(self._failures[0])
            if self.steps_done > attempt:
                return None
            # Below min_world_size, wait for newcomers before the redo. Only
            # here, where every member is (a member that had completed the
            # step is in its next one, or in train()'s final count, and the
            # next step's _maybe_admit waits instead).
            self._refill()
            if self.on_failure == "drop":
                self.steps_done += 1
                return None

    def train(self, steps: int, step_fn: Callable[[int], Any]) -> None:
        """Run ``step_fn(step)`` (forward and backward of this rank's share of
        step ``step``) until ``steps`` steps are done on every rank, surviving
        failures; returns once all ranks agree they are done."""
        self._train_until(steps, lambda: self.step(lambda: step_fn(self.steps_done)))

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """Everything this wrapper keeps, for a checkpoint: the model, the
        optimizer, the hook state (with this rank's residuals), ``extra_state``
        and the step count."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "hook": self.state.state_dict(), "steps_done": self.steps_done, **self._extras()}

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        self.module.load_state_dict(state["model"], strict=strict)
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.load_state_dict(state["hook"])
        self.steps_done = int(state["steps_done"])
        self._load_extras(state)

    def _optimizer_step(self) -> None:
        if self.grad_scaler is None:
            self.optimizer.step()
            return
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def _extra_objects(self):
        # A disabled GradScaler has an empty state, which it refuses to load.
        scaler = self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None
        return (("scheduler", self.scheduler), ("extra", self.extra_state), ("grad_scaler", scaler))

    def _extras(self) -> Dict[str, Any]:
        return {k: (v.state_dict() if v is not None else None) for k, v in self._extra_objects()}

    def _load_extras(self, state: Dict[str, Any]) -> None:
        for k, v in self._extra_objects():
            if v is not None and state.get(k) is not None:
                v.load_state_dict(state[k])

    # -------------------------------------------------------------- internals

    def _watching(self):
        """The current epoch group watches the communicator for the block (the group path)."""
        return self._epoch.watching() if self._epoch is not None else contextlib.nullcontext()

    def _rehearsal(self, closure: Callable[[], Any]) -> None:
        """Run ``closure`` once without sending anything (the buffers, such as
        batch-norm statistics, restored), so that DDP rebuilds its buckets
        as the members' were rebuilt; the gradients are discarded."""
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self._bypass = True
        try:
            self.optimizer.zero_grad()
            closure()
        finally:
            self._bypass = False
            self._rehearse = False
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers):
                b.copy_(saved)

    def _hook(self, _, bucket):  # unannotated: DDP checks a hook's annotations, which are strings here
        """The user's hook; a failure hands the bucket back untouched (DDP's
        state stays whole) and is remembered for the step."""
        buf = bucket.buffer()
        if self._bypass:
            # The members' states saw this initial layout first too: the order
            # a compressed hook names parameters by in checkpoints.
            observe = getattr(self.state, "_observe", None)
            if observe is not None:
                observe(bucket)
            return _hooks.completed(buf)
        if self._failures:
            return _hooks.completed(buf)
        try:
            fut = self.hook(self.state, bucket)
        except Exception as e:  # noqa: BLE001 - a CommError, or the hook's own error: step() sorts it
            self._failures.append(e)
            if self._epoch is not None:
                self._epoch.fail(str(e))  # now: peers blocked on this rank's group are freed at once
            return _hooks.completed(buf)

        if self._epoch is not None:
            return self._epoch.guard(fut, buf, self._failures)

        def settle(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001
                self._failures.append(e)
                return buf

        return fut.then(settle)

    def _bind(self, comm: Communicator) -> None:
        """Make the hook state (and a LocalSGD optimizer) use ``comm``; on the
        group path, over a new process group of ``comm``'s members (built
        collectively), the previous epoch's given up."""
        self.comm = comm
        old, self._epoch = self._epoch, None
        if old is not None:
            old.abandon()
        if self._group_device is not None:
            self._epoch = EpochGroup(comm, self._group_device)
        for st in (self.state, getattr(self.state, "inner", None)):
            if st is None:
                continue
            st._comm_arg = st._communicator = comm
            st.process_group = None
            if self._epoch is not None:
                # The communicator stays for what is not a bucket (the heal).
                st._comm_arg = None
                st.process_group, st._group_comm = self._epoch.pg, self._epoch.group_comm
                # A fresh thread (the old one may wait on the old group), which polls:
                # a given-up group's work may complete while this process exits.
                st._futures = GroupFutures(poll=True)
        if isinstance(self.state, _hooks.StaleState):
            self.state._inflight, self.state._started_step = [], -1
        if isinstance(getattr(self.optimizer, "communicator", None), Communicator):
            self.optimizer.communicator = comm

    def _recover(self, error: BaseException) -> None:
        """Shrink to the survivors (again while more die) and heal."""
        if isinstance(error, StateLost):  # no shrink brings the state back
            raise error
        t0 = time.monotonic()
        logger.warning("pycomm.elastic: rank %d of %d: step %d failed (%s); shrinking", self.comm.rank,
                       self.comm.world_size, self.steps_done, str(error).splitlines()[0][:200])
        shrink_and_adopt(lambda: self.comm, self._adopt, error, max_recoveries=self.max_recoveries,
                         timeout=self.shrink_timeout, grace=self.grace)
        self._event("shrink", t0, cause=str(error).splitlines()[0][:300])

    def _heal(self) -> None:
        """Make every rank's state the most advanced rank's (collective).

        Each rank says (not a newcomer, steps done, clean, hook iteration,
        first heal to come); the source is the lowest rank with the largest
        (not a newcomer, steps, clean). Its model, optimizer and extra state
        go to every rank when any rank differs from it (a newcomer, fewer
        steps, a half-applied step) or has its first heal to come; the step
        count and hook iteration always.
        """
        comm = self.comm
        newcomer, force = self._first_heal["newcomer"], self._first_heal["force"]
        mine = torch.tensor([0 if newcomer else 1, self.steps_done, 0 if self._dirty else 1, self.state.iteration,
                             int(force)], dtype=torch.int64)
        every = torch.empty(comm.world_size * 5, dtype=torch.int64)
        comm.all_gather(every, mine)
        rows = every.view(comm.world_size, 5).tolist()
        src = max(range(comm.world_size), key=lambda r: (rows[r][0], rows[r][1], rows[r][2], -r))
        best = rows[src]
        if not best[0]:  # a newcomer's state is its own initialization, not the training's
            raise StateLost("pycomm.elastic.FaultTolerantDDP: every survivor is a newcomer not healed yet: the "
                            "training's state is lost; restart it from a checkpoint (state_dict())")
        # Decided on what every rank said, so all of them broadcast or none.
        if any(row[4] for row in rows) or any(row[:3] != best[:3] for row in rows):
            self._send_state(src)
        self.steps_done, self.state.iteration, self._dirty = best[1], best[3], False
        self._first_heal = dict(force=False, newcomer=False)
        # Every member of the new membership has checked for newcomers at this
        # step (a newcomer, or a rank whose step's check came before a shrink,
        # would otherwise admit alone and wait for the others' bootstrap).
        self._admit_checked = self.steps_done

    def _send_state(self, src: int) -> None:
        """Rank ``src``'s model, optimizer, scheduler and extra state onto every rank."""
        mine = ({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), **self._extras()}
                if self.comm.rank == src else None)
        got = broadcast_state(self.comm, mine, src)
        if self.comm.rank != src:
            with torch.no_grad():
                self.module.load_state_dict(got["model"])
            self.optimizer.load_state_dict(got["optimizer"])
            self._load_extras(got)
