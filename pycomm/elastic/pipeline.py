"""Pipeline x data-parallel training that survives the death of ranks.

:class:`FaultTolerantPipeline` runs ``R`` replicas of an ``S``-rank pipeline
(:class:`pycomm.pipeline.Pipeline`, any schedule) over one job communicator
whose membership changes (:mod:`pycomm.elastic.membership`). The job's rank
``r`` is stage ``r % S`` of replica ``r // S``; each membership epoch gets
fresh communicators for every replica's pipeline and every stage's
data-parallel group, built over the job communicator's Store keys.

A step (:meth:`FaultTolerantPipeline.step`):

1. At a step boundary, every ``admit_every`` steps, newcomers waiting in
   :func:`pycomm.elastic.join` are admitted in groups of ``S`` (a whole
   replica: newcomer ``i`` of a group runs stage ``i``) and healed stage by
   stage from a surviving replica: parameters, optimizer and scheduler
   state, the step count.
2. The replica runs its share of the batch through its pipeline; each
   stage's gradients are averaged over the replicas.
3. Commit: a barrier over the job communicator. Once any rank passes it,
   every rank holds its stage's averaged gradients, so the step is applied
   everywhere, by a survivor during the recovery if a failure came between.
4. The optimizer steps; ``steps_done`` grows by one.

A failure anywhere (a rank dies or freezes) makes every rank's step raise
within milliseconds (the pipeline aborts its communicators). The survivors
shrink the job communicator to as many whole replicas as they can form
(:func:`regroup`): the replicas that survived whole, and survivors of broken
replicas paired up stage by stage, each keeping its stage's state (a stage
short of survivors is filled by one left over, healed from a holder). The
job goes on as long as every stage's state survives on one rank, not only
while one replica survives whole. Survivors beyond whole replicas are
fenced out and, with ``rejoin`` (default), join the job again as newcomers,
to form a replacement replica with new processes. Then the step is redone
by the remaining replicas, the batch split among them
(``on_failure="redo"``), or skipped (``"drop"``).

Example (every rank; a replacement runs the same script and joins)::

    comm = pycomm.elastic.join(store, "train") if joining else \\
        pycomm.Communicator(store=store, rank=rank, world_size=world, name="train")
    ft = pycomm.elastic.FaultTolerantPipeline(
        lambda stage: make_stage(stage), lambda params: torch.optim.SGD(params, lr=0.1), comm,
        num_stages=2, num_microbatches=4, schedule="1f1b", loss_fn=nn.functional.cross_entropy)

    def batch(step, replica, replicas):       # this replica's share of step `step`
        x, y = data(step)
        return x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]

    ft.train(1000, batch)
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .. import bootstrap
from .._loader import CommError
from ..communicator import Communicator
from ..pipeline import Pipeline, get_schedule, stages_of
from .heal import broadcast_state
from .loop import ElasticLoop
from .membership import FencedOut, StateLost, _fence, _member_records, join, shrink_and_adopt

logger = logging.getLogger("pycomm")

ON_FAILURE = ("redo", "drop")
BatchFn = Callable[[int, int, int], Tuple[Any, Any]]


class FaultTolerantPipeline(ElasticLoop):
    """Pipeline x data parallelism that shrinks, heals and goes on when a rank
    dies, and admits whole replacement replicas (see the module's docstring).

    Args:
        stage_fn: ``stage_fn(i)`` builds model stage ``i`` (a rank builds the
            stages its place in the pipeline holds under the schedule, again
            if a change of membership gives it another place).
        optimizer_fn: ``optimizer_fn(params)`` builds the optimizer of this
            rank's stages.
        comm: the job communicator (every rank of every replica), or one from
            :func:`pycomm.elastic.join`; its world must be a multiple of
            ``num_stages``.
        num_stages: ranks per pipeline replica.
        num_microbatches, schedule, virtual_stages, loss_fn, loss_reduction,
            checkpoint: as :class:`pycomm.pipeline.Pipeline`'s.
        scheduler_fn: ``scheduler_fn(optimizer)`` builds an LR scheduler,
            stepped with the optimizer and healed with it.
        on_failure: ``"redo"`` the failed step with the remaining replicas
            (default) or ``"drop"`` it.
        admit_every: admit waiting newcomers every this many steps (0: never).
        max_world_size: never grow past this many ranks (None: no bound;
            else at least ``num_stages``): replicas beyond it wait in
            ``join`` as spares until a failure makes room.
        min_world_size, min_world_timeout: never train with fewer ranks
            than this (None: go on with any whole replica); as
            FaultTolerantDDP's.
        rejoin: a survivor of a broken replica joins the job again as a
            newcomer (else it raises :class:`pycomm.elastic.FencedOut`).
        shrink_timeout, grace, max_recoveries: as FaultTolerantDDP's.
        join_timeout: seconds a rejoining rank waits for its admission.
    """

    def __init__(self, stage_fn: Callable[[int], nn.Module],
                 optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], comm: Communicator, *,
                 num_stages: int, num_microbatches: int, schedule: str = "1f1b",
                 virtual_stages: Optional[int] = None, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 loss_reduction: str = "mean", checkpoint: bool = False,
                 scheduler_fn: Optional[Callable[[torch.optim.Optimizer], Any]] = None, on_failure: str = "redo",
                 admit_every: int = 10, max_world_size: Optional[int] = None,
                 min_world_size: Optional[int] = None, min_world_timeout: float = 600.0, rejoin: bool = True,
                 shrink_timeout: float = 30.0, grace: float = 2.0, max_recoveries: int = 8,
                 join_timeout: float = 300.0) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"pycomm.elastic.FaultTolerantPipeline: comm must be a pycomm.Communicator, got "
                            f"{type(comm).__name__}")
        if num_stages < 1 or comm.world_size % num_stages:
            raise ValueError(f"pycomm.elastic.FaultTolerantPipeline: {comm.world_size} ranks cannot form "
                             f"pipelines of num_stages={num_stages} ranks")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"pycomm.elastic.FaultTolerantPipeline: on_failure={on_failure!r}; use 'redo' or "
                             "'drop'")
        self.num_stages = int(num_stages)
        self._set_admission("FaultTolerantPipeline", admit_every, max_world_size, min_world_size, min_world_timeout)
        self.stage_fn, self.optimizer_fn, self.scheduler_fn = stage_fn, optimizer_fn, scheduler_fn
        self._pipeline_args = dict(num_microbatches=num_microbatches, schedule=schedule,
                                   virtual_stages=virtual_stages, loss_fn=loss_fn, loss_reduction=loss_reduction,
                                   checkpoint=checkpoint)
        self.on_failure, self.rejoin = on_failure, bool(rejoin)
        self.shrink_timeout, self.grace, self.max_recoveries = float(shrink_timeout), float(grace), int(max_recoveries)
        self.join_timeout = float(join_timeout)
        self.steps_done = 0
        #: Membership changes: dicts of kind ("shrink", "admit", "rejoin"), step, world, epoch, seconds
        #: (a shrink: its cause, and ``regrouped``, replicas formed anew from survivors of broken ones).
        self.events: List[Dict[str, Any]] = []
        self.stage = -1
        self.module: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler: Any = None
        self.pipe: Optional[Pipeline] = None
        self._reduced = False      # this step's gradients are averaged; the commit is pending
        self._newcomer = comm.joined
        self._lost_stages: List[int] = []  # what the last regroup found held by no survivor
        self._force = not comm.joined  # the job's first heal: every replica takes replica 0's state
        self._admit_checked = -1
        self.comm = comm
        try:
            self._bind(comm)
            self._heal()
        except FencedOut:
            raise
        except CommError as e:
            self._recover(e)

    # ------------------------------------------------------------ the grid

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def replica(self) -> int:
        """This rank's pipeline replica."""
        return self.comm.rank // self.num_stages

    @property
    def replicas(self) -> int:
        return self.comm.world_size // self.num_stages

    @property
    def is_first(self) -> bool:
        return self.pipe is not None and self.pipe.is_first

    @property
    def is_last(self) -> bool:
        return self.pipe is not None and self.pipe.is_last

    # ------------------------------------------------------------ training

    def step(self, batch_fn: BatchFn) -> Optional[torch.Tensor]:
        """One training step: ``batch_fn(step, replica, replicas)`` gives this
        replica's ``(inputs, targets)``; returns the loss on the rank holding
        the last stage (None elsewhere, and when the step was dropped or
        applied during a recovery). A rank of a broken replica rejoins inside
        (``rejoin``) or raises :class:`pycomm.elastic.FencedOut`."""
        self._maybe_admit()
        for _ in range(self.max_recoveries + 1):
            attempt = self.steps_done
            try:
                return self._attempt(batch_fn)
            except CommError as e:
                self._recover(e)
            if self.steps_done > attempt:
                return None
            self._refill()  # before the redo (see FaultTolerantDDP.step)
            if self.on_failure == "drop":
                self.steps_done += 1
                return None
        raise CommError(f"pycomm.elastic: step {self.steps_done} failed {self.max_recoveries + 1} times")

    def train(self, steps: int, batch_fn: BatchFn) -> None:
        """Run steps until ``steps`` are done on every rank, surviving failures."""
        self._train_until(steps, lambda: self.step(batch_fn))

    def state_dict(self) -> Dict[str, Any]:
        """This rank's stages, optimizer, scheduler and step count (a checkpoint)."""
        return dict(self._state(), steps_done=self.steps_done, stage=self.stage)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of a rank that held the same stage (a
        restart from a checkpoint; every rank loads its own, then trains)."""
        if state.get("stage") != self.stage:
            raise ValueError(f"pycomm.elastic.FaultTolerantPipeline: this checkpoint holds stage {state.get('stage')}; "
                             f"this rank runs stage {self.stage}")
        self._load(state)
        self.steps_done = int(state["steps_done"])

    def _state(self) -> Dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def _load(self, state: Dict[str, Any]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def _attempt(self, batch_fn: BatchFn) -> Optional[torch.Tensor]:
        self.optimizer.zero_grad()
        inputs, targets = batch_fn(self.steps_done, self.replica, self.replicas)
        loss = self.pipe.step(inputs if self.is_first else None, targets if self.is_last else None)
        self._reduced = True
        self.comm.barrier()  # the commit (see the module's docstring)
        self._apply()
        return loss

    def _apply(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps_done += 1
        self._reduced = False

    # ------------------------------------------------------------ membership

    def _bind(self, comm: Communicator) -> None:
        """Take ``comm`` as the job communicator: this rank's place, its
        stages (built anew if the place changed) and the epoch's pipeline and
        data-parallel communicators."""
        S = self.num_stages
        if comm.world_size % S:
            raise CommError(f"pycomm.elastic.FaultTolerantPipeline: a world of {comm.world_size} ranks is not "
                            f"whole pipelines of {S}")
        self._close_pipeline()
        self.comm = comm
        replica, stage = divmod(comm.rank, S)
        if stage != self.stage:
            held = stages_of(get_schedule(self._pipeline_args["schedule"], self._pipeline_args["virtual_stages"]),
                             S, stage)
            modules = [self.stage_fn(i) for i in held]
            self.module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
            self.optimizer = self.optimizer_fn(self.module.parameters())
            self.scheduler = self.scheduler_fn(self.optimizer) if self.scheduler_fn is not None else None
            self._newcomer = self._newcomer or self.stage >= 0  # a new place: its state comes from a peer
            self.stage = stage
        settings = dict(comm._settings, bind_cores=False)
        # Each sub-communicator's ranks, by their rank in `comm`: the process
        # records every rank published when it built `comm` tell a sub-bootstrap
        # at once of a peer that died or stopped before it got there (a
        # newcomer killed right after its admission held the others for the
        # whole timeout: its record in the sub-bootstrap's keys never came).
        records = _member_records(comm)
        subs = [(f"pipe{replica}", stage, [replica * S + s for s in range(S)]),
                (f"dp{stage}", replica, [q * S + stage for q in range(comm.world_size // S)])]
        subs = [sub for sub in subs if len(sub[2]) > 1 or sub[0].startswith("pipe")]
        built: List[Communicator] = []
        try:
            for name, rank, ranks in subs:
                sub = Communicator(store=comm._root_store, rank=rank, world_size=len(ranks),
                                   name=f"{comm.name}/{name}", timeout=comm.timeout, _host_label=comm._host_label,
                                   _stopped_after=comm.heartbeat_timeout or None,
                                   _known_peers={i: records[r] for i, r in enumerate(ranks)}, **settings)
                sub.heartbeat_timeout = comm.heartbeat_timeout
                built.append(sub)
        except BaseException:
            for sub in built:
                _fence(sub, "pycomm.elastic: a peer failed while the pipeline's communicators were built", [])
            # The peers still waiting in the sub-bootstraps this rank leaves
            # (alive, so not seen lost) give up at once instead of at their
            # timeout. Each epoch's names are new: no later build reads this.
            for name, _, _ in subs[len(built):]:
                try:
                    bootstrap.key_space(comm._root_store, f"{comm.name}/{name}").set(bootstrap.BUILD_VERDICT_KEY,
                                                                                     "failed")
                except Exception as e:  # noqa: BLE001 - the Store is gone: the peers' own bootstraps fail too
                    logger.debug("pycomm.elastic: could not mark %s given up: %s", name, e)
            raise
        modules = list(self.module) if isinstance(self.module, nn.ModuleList) else [self.module]
        self.pipe = Pipeline(modules if len(modules) > 1 else modules[0], built[0],
                             dp_comm=built[1] if len(built) > 1 else None, **self._pipeline_args)

    def _close_pipeline(self) -> None:
        if self.pipe is None:
            return
        for sub in (self.pipe.comm, self.pipe.dp_comm):
            if sub is not None:
                # Its inter-host connections closed too: a peer on another
                # host blocked on this rank raises now.
                _fence(sub, "pycomm.elastic: this pipeline's communicators were replaced by a change of "
                            "membership", [])
        self.pipe = None

    def _shrinking(self) -> Communicator:
        """The communicator to shrink, once this rank said in its keys
        whether it holds its stage's state (what :meth:`_select` reads: a
        newcomer not healed yet holds none)."""
        comm = self.comm
        holds = not self._newcomer and self.stage == comm.rank % self.num_stages
        try:
            _holds_keys(comm).set(str(comm.rank), str(int(holds)))
        except Exception as e:  # the Store's own errors, said as shrink says them
            raise CommError(f"pycomm.elastic: the Store cannot be reached ({type(e).__name__}: {e})") from e
        return comm

    def _select(self, seen: List[int]) -> List[int]:
        """Which survivors (ranks of the communicator being shrunk) form the
        new membership, replica by replica (see :func:`regroup`)."""
        # Every rank that checked in said it first (_shrinking).
        holds = {r: v == b"1" for r, v in zip(seen, _holds_keys(self.comm).multi_get([str(r) for r in seen]))}
        members, self._lost_stages = regroup(seen, holds, self.num_stages)
        return members

    def _recover(self, error: BaseException) -> None:
        """Shrink to the replicas the survivors can form (again while more
        die) and heal; a survivor left over rejoins or raises FencedOut."""
        if isinstance(error, StateLost):  # no shrink brings the state back
            raise error
        t0 = time.monotonic()
        logger.warning("pycomm.elastic: rank %d of %d (stage %d of replica %d): step %d failed (%s); shrinking",
                       self.comm.rank, self.comm.world_size, self.stage, self.replica, self.steps_done,
                       str(error).splitlines()[0][:200])
        # The pipeline's communicators first: a peer blocked in one of them
        # (across hosts, in a process group) raises now and comes to shrink,
        # instead of after the grace, left out with its whole replica.
        self._close_pipeline()
        try:
            shrink_and_adopt(self._shrinking, self._adopt, error, max_recoveries=self.max_recoveries,
                             timeout=self.shrink_timeout, grace=self.grace, select=self._select)
        except FencedOut as e:
            if not e.members:
                lost = f"stage {', '.join(map(str, self._lost_stages))}" if self._lost_stages else "some stage"
                raise StateLost(f"pycomm.elastic.FaultTolerantPipeline: no survivor holds the state of {lost}; "
                                "the training cannot go on (restart it from a checkpoint)") from e
            if not self.rejoin:
                raise
            self._rejoin(t0)
            return
        regrouped = self._regrouped()
        self._event("shrink", t0, cause=str(error).splitlines()[0][:300],
                    **({"regrouped": regrouped} if regrouped else {}))

    def _regrouped(self) -> int:
        """How many replicas the last shrink formed anew from survivors of
        broken ones (not a replica that survived whole)."""
        S, parents = self.num_stages, self.comm.parent_ranks or []
        return sum(parents[i:i + S] != [parents[i] - parents[i] % S + s for s in range(S)]
                   for i in range(0, len(parents), S))

    def _rejoin(self, t0: float) -> None:
        """This rank's replica broke and the survivors' replicas left it
        out: join the job again as a newcomer."""
        self._close_pipeline()
        root, job = self.comm._root_store, self.comm.job
        logger.warning("pycomm.elastic: rank %d: its pipeline replica broke and no regrouped replica took it; "
                       "joining %r again", self.comm.rank, job)
        for _ in range(self.max_recoveries):
            try:
                comm = join(root, job, timeout=self.join_timeout)
            except CommError as e:
                logger.warning("pycomm.elastic: rejoining failed (%s); again", e)
                continue
            self._newcomer = True
            try:
                self._bind(comm)
                self._heal()
            except CommError as e:
                # A member of the new epoch now: recover with the others
                # (still a newcomer until a heal completes).
                self.comm = comm
                self._recover(e)
                return
            self._event("rejoin", t0)
            return
        raise CommError(f"pycomm.elastic: this rank could not rejoin {job!r} in {self.max_recoveries} attempts")

    def _heal(self) -> None:
        """Every rank at the same step with its stage's state (collective).

        Each rank says (newcomer, steps done, gradients averaged but the step
        not applied, first heal). With ``top`` the most steps a member did: a
        member one step behind with its gradients averaged applies the step
        now (a member at ``top`` passed the commit, so every rank averaged);
        then in each stage's data-parallel group the lowest member at ``top``
        sends its state to every rank that is behind (newcomers), or to all
        at the job's first heal.
        """
        comm, S = self.comm, self.num_stages
        mine = torch.tensor([int(self._newcomer), self.steps_done, int(self._reduced), int(self._force)],
                            dtype=torch.int64)
        every = torch.empty(comm.world_size * 4, dtype=torch.int64)
        comm.all_gather(every, mine)
        rows = every.view(comm.world_size, 4).tolist()
        members = [r for r, row in enumerate(rows) if not row[0]]
        if not members:
            raise StateLost("pycomm.elastic.FaultTolerantPipeline: every rank is a newcomer not healed yet: the "
                            "training's state is lost; restart it from a checkpoint (state_dict())")
        top = max(rows[r][1] for r in members)

        def current(r: int) -> bool:  # at `top` once the roll-forward is done
            row = rows[r]
            return not row[0] and (row[1] == top or (row[1] == top - 1 and row[2] == 1))

        if not self._newcomer and self.steps_done == top - 1 and self._reduced:
            self._apply()
        group = [r for r in range(comm.world_size) if r % S == self.stage]
        sources = [r for r in group if current(r)]
        if not sources:
            raise StateLost(f"pycomm.elastic.FaultTolerantPipeline: no member holds stage {self.stage}'s state at "
                            f"step {top}; restart the training from a checkpoint (state_dict())")
        if len(group) > 1 and (any(row[3] for row in rows) or not all(current(r) for r in group)):
            src = sources[0]
            got = broadcast_state(self.pipe.dp_comm, self._state() if comm.rank == src else None, src // S)
            if comm.rank != src:
                self._load(got)
        self.steps_done, self._reduced, self._newcomer, self._force = top, False, False, False
        # Every rank of this membership checked for newcomers at this step.
        self._admit_checked = self.steps_done

    @property
    def _admit_multiple(self) -> int:  # newcomers come as whole replicas
        return self.num_stages

    def _world_text(self) -> str:
        return f"world {self.comm.world_size} ({self.replicas} replicas)"


def _holds_keys(comm: Communicator) -> torch.distributed.Store:
    """Where the ranks of ``comm`` say, before they shrink it, whether they
    hold their stage's state (written by _shrinking, read by _select)."""
    return bootstrap.key_space(comm._root_store, comm.name, "elastic/holds/")


def regroup(seen: List[int], holds: Dict[int, bool], num_stages: int) -> Tuple[List[int], List[int]]:
    """The membership that survivors ``seen`` (ranks of the old job
    communicator, where rank ``r`` ran stage ``r % num_stages``; ``holds[r]``:
    whether it holds its stage's state) regroup into, and the stages whose
    state no survivor holds (then none: the job cannot go on).

    As many whole replicas as the survivors make, ``len(seen) // S``: the
    replicas that survived whole stay as they were; the other survivors are
    paired up stage by stage, a holder keeping its stage, and a stage short
    of holders filled by a survivor left over (a newcomer not healed yet
    first, a holder of another stage next), which is healed from a holder
    of that stage. Survivors beyond whole replicas are left out (they rejoin
    as newcomers). Returns the members in the order of their new ranks:
    rank ``i * S + s`` runs stage ``s`` of replica ``i``.

    Example: 2 replicas of 2 stages lose rank 1 (replica 0's stage 1) and
    rank 2 (replica 1's stage 0); ranks 0 and 3 form one replica::

        regroup([0, 3], {0: True, 3: True}, 2)   # ([0, 3], [])
    """
    S = num_stages
    lost = [s for s in range(S) if not any(holds.get(r) for r in seen if r % S == s)]
    if lost:
        return [], lost
    whole = [q for q in sorted({r // S for r in seen})
             if all(q * S + s in seen and holds.get(q * S + s) for s in range(S))]
    rest = [r for r in seen if r // S not in whole]
    extra = len(seen) // S - len(whole)
    slots: List[List[int]] = [[r for r in rest if r % S == s and holds.get(r)][:extra] for s in range(S)]
    taken = {r for slot in slots for r in slot}
    spare = sorted((r for r in rest if r not in taken), key=lambda r: bool(holds.get(r)))
    for s, slot in enumerate(slots):
        while len(slot) < extra:
            # One already at stage s keeps its built modules (healed all the same).
            pick = next((r for r in spare if r % S == s), spare[0])
            spare.remove(pick)
            slot.append(pick)
    return [q * S + s for q in whole for s in range(S)] + [slots[s][i] for i in range(extra) for s in range(S)], []
