"""Membership of a communicator: shrinking it to its survivors, growing it by newcomers.

After a peer dies, every survivor's collective raises :class:`pycomm.CommError`
within milliseconds; :func:`shrink` then gives the survivors a new
communicator with renumbered ranks — a fresh segment, a fresh inter-host
group, a fresh sequence — without restarting any process (what NCCL's
``ncclCommShrink`` and torchcomms' revoke/shrink do).

How the survivors agree (through the Store, which must outlive every rank:
torchrun's agent store, or a TCPStore whose host is not a training rank):

1. Each caller first aborts the old communicator: every later call on it,
   by anyone, raises, and a peer still blocked in one of its collectives
   (waiting on this rank, perhaps across hosts) raises at once and comes to
   shrink too.
2. It checks in under the shrink's keys and waits for the ranks it does not
   know to be gone (``exclude``, and :meth:`Communicator.gone_ranks`: a dead
   or frozen local process, the rank a failure blamed as dead) for at most
   ``grace`` seconds; a rank that has not checked in by then is taken as
   failed (a second death during the shrink).
3. The first rank to get there proposes the members it saw (checked in, not
   excluded) with one compare-and-set: exactly one proposal wins, every
   caller reads the same list, so there are never two different groups. A
   rank not in it (excluded, or too late) gets a CommError saying it was
   fenced out.
4. The members build the new communicator under keys of their own. If a
   member dies before it joins, the build fails after ``timeout`` seconds on
   every member with a CommError: call ``shrink`` again on the old
   communicator (each attempt agrees under new keys).

Growing (:func:`admit`, :func:`join`): a new process calls
``elastic.join(store, job)``, which takes a ticket in the Store and
waits; the members call ``elastic.admit(comm)`` at a step boundary, agree with one
compare-and-set on the tickets to take (every member reads the same list),
and all of them, newcomers included, build the communicator of epoch e+1:
the members keep their ranks, the newcomers come after them in ticket order.
``admit`` with nobody waiting costs two Store operations and returns ``comm``.

Fencing: keys, segment names and the inter-host group of epoch e+1 are new,
so a rank that was excluded (frozen, partitioned, too late) cannot reach
them; its old communicator is aborted, so its next call raises. Example::

    comm = pycomm.Communicator(store=store, rank=rank, world_size=world)
    for step in range(steps):
        try:
            comm.all_reduce(grad, op="avg")
        except pycomm.CommError:
            comm = elastic.shrink(comm)  # survivors only; redo or drop this step
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from .. import bootstrap
from .._loader import CommError

if TYPE_CHECKING:
    from ..communicator import Communicator

logger = logging.getLogger("pycomm")

# How often a waiting survivor polls the Store for the others' check-ins.
_POLL_S = 0.002
# A joiner publishes its process record right after taking its ticket (two
# Store calls): a ticket still without one after this long belongs to a
# process that died in between, and its admission would hold every member's
# bootstrap for the whole timeout.
_RECORD_GRACE_S = 1.0


class FencedOut(CommError):
    """Raised by :func:`shrink` on a rank the survivors left out (excluded, not
    selected, or too late to check in): it can never take part in this
    communicator's epochs again (it may :func:`join` the job anew).
    ``members``: the old ranks the survivors agreed on."""

    def __init__(self, message: str, members: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.members: List[int] = list(members)


class StateLost(CommError):
    """Raised by the fault-tolerant trainers when no survivor holds the
    training's state (every survivor a newcomer not healed yet, or, in a
    pipeline, no survivor of some stage): no shrink can bring it back, so
    every survivor raises at once. Restart from a checkpoint."""


def _kept(comm: "Communicator") -> Dict[str, float]:
    """The settings a communicator's successor keeps (a user may have changed them since it was built)."""
    return dict(timeout=comm.timeout, heartbeat_timeout=comm.heartbeat_timeout)


class _Fenced:
    """What a shrunk communicator's compiled part is replaced by: every use
    raises why, except what another shrink of it reads (a retry)."""

    def __init__(self, why: str, kept: Dict[str, float], gone: List[int]) -> None:
        self._why, self._gone = why, gone
        self.timeout, self.heartbeat_timeout = kept["timeout"], kept["heartbeat_timeout"]

    def __getattr__(self, name: str):
        if name in ("shutdown", "abort"):  # closing or aborting it again is harmless
            return lambda *a, **k: None
        if name == "gone_ranks":
            return lambda: list(self._gone)
        if name == "failure":
            return lambda: self._why
        raise CommError(self._why)


def _fence(comm: "Communicator", why: str, gone: List[int]) -> None:
    """Abort, close and drop ``comm``'s compiled part: every later call on it,
    by anyone, raises ``why``."""
    kept = _kept(comm)
    comm.abort(why, name_rank=False)
    comm._c.shutdown()  # not close(): a shrink builds the successor from its store
    # Closing leaves the inter-host connections open until the compiled
    # communicator is gone, and a Work or future still held (by DDP, by a
    # caught exception's frames) keeps it alive; a peer on another host
    # blocked on this rank would wait out its timeout. Shutting the private
    # Gloo group down closes them now (a peer blocked in a receive raises
    # within milliseconds); it takes ~0.1 s, so off the shrink's path.
    backend, comm._own_inter_host = getattr(comm, "_own_inter_host", None), None
    if backend is not None:
        threading.Thread(target=_shutdown_quietly, args=(backend,), name="pycomm-fence", daemon=True).start()
    comm._c = _Fenced(why, kept, gone)


def _shutdown_quietly(backend: Any) -> None:
    try:
        backend.shutdown()
    except Exception as e:  # noqa: BLE001 - already broken: nothing left to close
        logger.debug("pycomm: shutting the fenced inter-host group down: %s", e)


def _successor(comm: "Communicator", rank: int, world: int, name: str, timeout: float,
               parent_ranks: List[int], known: Dict[int, str]) -> "Communicator":
    """The communicator of epoch ``comm.epoch + 1`` (fresh keys under
    ``name``, the same hosts, settings and job), rank ``rank`` of ``world``;
    ``comm`` is fenced (it kept what its successor inherits). ``known``: the
    process records (:func:`pycomm.bootstrap.process_record`) of its ranks
    read beforehand, so that one dying before its bootstrap starts is seen."""
    new = _build(comm._root_store, rank, world, name, timeout, comm._host_label, comm._settings,
                 _kept(comm)["heartbeat_timeout"], known)
    _inherit(new, comm.job, comm.epoch + 1, _kept(comm), parent_ranks, comm._admitted_upto)
    return new


def _build(root: "dist.Store", rank: int, world: int, name: str, timeout: float, host_label: Optional[str],
           settings: Dict[str, Any], heartbeat: float, known: Dict[int, str]) -> "Communicator":
    """A new communicator that every rank of it has, or a CommError on every rank.

    Building can fail on some ranks only (a rank dies after the rendezvous):
    each rank then says whether it got one, and one compare-and-set decides
    for all — "ok" only if every rank built it in time — so no rank goes on
    with a communicator another rank gave up. A rank of this host that dies,
    or stays stopped ``heartbeat`` seconds, meanwhile ends the build at once
    (:class:`pycomm.bootstrap.BootstrapWatch`; ``known``: records of ranks
    read beforehand); one on another host, at ``timeout``.
    """
    from ..communicator import Communicator

    keys = bootstrap.key_space(root, name)
    stopped_after = heartbeat or timeout  # a heartbeat of 0 judges nobody
    new, error = None, None
    try:
        new = Communicator(store=root, rank=rank, world_size=world, name=name, timeout=timeout,
                           _host_label=host_label, _stopped_after=stopped_after, _known_peers=known, **settings)
    except CommError as e:
        error = e
    verdict = "failed"
    try:
        if new is not None:
            keys.set(f"built/{rank}", "1")
            # Every rank's vote, or a verdict already taken (a rank that
            # failed says so at once), or the deadline.
            everyone = [f"built/{r}" for r in range(world)]
            deadline = time.monotonic() + timeout
            watch = bootstrap.BootstrapWatch(keys, rank, world, stopped_after, known)
            while not keys.check([bootstrap.BUILD_VERDICT_KEY]) and time.monotonic() < deadline:
                if keys.check(everyone):
                    verdict = "ok"
                    break
                why = watch.check() if watch.due() else None
                if why:
                    error = bootstrap.peer_lost(
                        CommError(f"pycomm: {why} before it finished building the communicator"))
                    break
                time.sleep(_POLL_S)
        verdict = _first_proposal(keys, bootstrap.BUILD_VERDICT_KEY, verdict)
    except Exception as e:
        error = error or CommError(f"the Store cannot be reached ({type(e).__name__}: {e})")
        verdict = "failed"
    if verdict != "ok":
        if new is not None:
            new.abort("a rank did not finish building this communicator", name_rank=False)
            new.close()
        # Without an error of its own, another rank gave the build up (its
        # own reason is its own): most often a peer it saw lost.
        raise error or bootstrap.peer_lost(CommError("another rank did not finish building the communicator"))
    return new


def attempt_cost(error: BaseException) -> float:
    """What a failed recovery attempt costs a wrapper's ``max_recoveries``:
    1, or a quarter when it failed because another peer was lost meanwhile
    (its build or its heal saw one die or freeze): the next attempt, without
    that peer, can succeed, and a run of failures keeps the training going
    for as long as each one removes somebody."""
    lost = getattr(error, "peer_lost", False) or getattr(error, "failure", None) in ("died", "silent")
    return 0.25 if lost else 1.0


def shrink_and_adopt(current: Callable[[], "Communicator"], adopt: Callable[["Communicator"], None],
                     error: BaseException, *, max_recoveries: int, timeout: float, grace: float,
                     select: Optional[Callable[[List[int]], List[int]]] = None) -> None:
    """A wrapper's recovery from ``error``: :func:`shrink` the current
    communicator (``current()``) and ``adopt`` the result (rebind, heal),
    again while attempts fail, within ``max_recoveries`` (see
    :func:`attempt_cost`). FencedOut and StateLost are raised as they are;
    CommError when the budget runs out."""
    budget = float(max_recoveries)
    while budget > 0:
        try:
            new = shrink(current(), timeout=timeout, grace=grace, select=select)
        except FencedOut:
            raise
        except CommError as e:
            logger.warning("pycomm.elastic: shrink failed (%s); again", e)
            budget -= attempt_cost(e)
            continue
        try:
            adopt(new)
        except StateLost:
            raise
        except CommError as e:
            logger.warning("pycomm.elastic: healing failed (%s); shrinking again", e)
            budget -= attempt_cost(e)
            continue
        return
    raise CommError(f"pycomm.elastic: could not recover within {max_recoveries} failed shrinks; first failure: "
                    f"{error}")


def _as_lost(cause: BaseException, error: CommError) -> CommError:
    """``error`` keeps ``cause``'s mark of a lost peer (see :func:`pycomm.bootstrap.peer_lost`)."""
    if getattr(cause, "peer_lost", False):
        bootstrap.peer_lost(error)
    return error


def _inherit(new: "Communicator", job: str, epoch: int, kept: Dict[str, float], parent_ranks: List[int],
             admitted_upto: int) -> None:
    new.timeout, new.heartbeat_timeout = kept["timeout"], kept["heartbeat_timeout"]
    new.job, new.epoch, new.parent_ranks, new._admitted_upto = job, epoch, list(parent_ranks), admitted_upto


def _job_store(root: "dist.Store", job: str) -> "dist.Store":
    """Where newcomers of ``job`` take tickets and read their admission."""
    return bootstrap.key_space(root, job, "elastic/joins/")


def _first_proposal(store: "dist.Store", key: str, proposal: str) -> str:
    """``proposal`` if it is the first made under ``key``, else the one that
    was: every rank that asks reads the same answer."""
    decided = store.compare_set(key, "", proposal)
    return decided.decode() if isinstance(decided, bytes) else decided


# A ticket's claim (`claim/<ticket>` in the job's keys): the admit call that
# agreed to take it, or this, written by a newcomer that stopped waiting.
_WITHDRAWN = "withdrawn"


def _claim(js: "dist.Store", ticket: int, claimant: str) -> str:
    """Claims ``ticket`` for ``claimant`` unless it was claimed before; returns the claim that holds."""
    return _first_proposal(js, f"claim/{ticket}", claimant)


def _successor_name(comm: "Communicator", epoch: int, tag: str) -> str:
    """The name of a communicator that replaces ``comm`` as epoch ``epoch``
    (``tag``: which shrink attempt or admit call): the job, the epoch and a
    digest of ``comm``'s name and the tag. Unique as the lineage of
    replacements is, which keeps every epoch's keys apart, yet bounded: a
    name that spelled out its lineage grew by a few characters with every
    change of membership (~1 KB after a 200-failure soak), in every Store
    key and log line of the job."""
    digest = hashlib.sha1(f"{comm.name}{tag}".encode()).hexdigest()[:12]
    return f"{comm.job}@{epoch}.{digest}"


def _members_key(epoch: int) -> str:
    return f"epoch{epoch}/members"


def _agreement_store(comm: "Communicator", attempt: int) -> "dist.Store":
    """Where the ranks of ``comm`` agree in their ``attempt``-th shrink of it."""
    return bootstrap.key_space(comm._root_store, comm.name, f"elastic/a{attempt}/")


def shrink(comm: "Communicator", exclude: Sequence[int] = (), *, timeout: float = 30.0,
           grace: float = 2.0, select: Optional[Callable[[List[int]], List[int]]] = None) -> "Communicator":
    """The survivors of ``comm`` in a new communicator (see the module's docstring).

    Args:
        comm: the communicator to shrink; every surviving rank passes its own.
        exclude: ranks of ``comm`` to leave out although they may be alive.
        timeout: seconds the new communicator's bootstrap may take (a member
            that died meanwhile makes it fail after this long).
        grace: seconds to wait for ranks not known to be gone to check in.
        select: which of the ranks that checked in stay, in the order of
            their new ranks (a function of their sorted list; say, whole
            pipeline replicas, stage by stage); the others are fenced out.
            Each rank calls it; the first proposal holds for all.

    Returns the new communicator: its ``epoch`` one more than ``comm``'s, its
    timeout and heartbeat bound ``comm``'s, and ``parent_ranks`` the members' ranks in ``comm``
    (its rank r was rank ``parent_ranks[r]`` of ``comm``). Raises CommError on a rank that is fenced out, on
    every member if one dies before the new communicator is built, and with a
    clear message if the Store cannot be reached.
    """
    world, me = comm.world_size, comm.rank
    bad = [r for r in exclude if not 0 <= int(r) < world]
    if bad:
        raise CommError(f"pycomm.shrink: exclude={list(exclude)} names ranks outside 0..{world - 1}")
    excluded = {int(r) for r in exclude}
    attempt = getattr(comm, "_shrink_attempts", 0)
    comm._shrink_attempts = attempt + 1
    epoch = comm.epoch + 1
    store = _agreement_store(comm, attempt)
    t0 = time.monotonic()
    gone = set(comm.gone_ranks()) | excluded
    # 1. Fence the old communicator first, for everybody: a peer still
    #    blocked in one of its collectives (waiting on this rank, perhaps
    #    across hosts) raises now and comes to shrink too, instead of at its
    #    timeout.
    why = (f"pycomm: communicator {comm.name!r} (epoch {comm.epoch}) is being replaced by a shrink; use the "
           "communicator shrink() returns")
    _fence(comm, why, sorted(gone - excluded))
    try:
        # 2. Check in, then wait for everybody not known to be gone.
        store.set(f"alive/{me}", bootstrap.process_record())
        waiting = [r for r in range(world) if r not in gone and r != me]
        deadline = time.monotonic() + grace
        while waiting and time.monotonic() < deadline and not store.check([_members_key(epoch)]):
            waiting = [r for r in waiting if not store.check([f"alive/{r}"])]
            if waiting:
                time.sleep(_POLL_S)
        seen = [r for r in range(world) if r not in excluded and (r == me or store.check([f"alive/{r}"]))]
        if select is not None:
            seen = [r for r in dict.fromkeys(select(seen)) if r in seen]
        # 3. One proposal wins; everybody reads it.
        members: List[int] = json.loads(_first_proposal(store, _members_key(epoch), json.dumps(seen)))
    except CommError:
        raise
    except Exception as e:  # the Store's own errors: its host is gone, or a timeout
        raise CommError(f"pycomm.shrink: the Store cannot be reached ({type(e).__name__}: {e}); shrinking needs "
                        "a Store that outlives every training rank (torchrun's agent store, or a TCPStore "
                        "hosted outside the ranks)") from e
    if me not in members:
        raise FencedOut(f"pycomm.shrink: rank {me} was fenced out of {comm.name!r}: the survivors agreed on ranks "
                        f"{members} of epoch {epoch}" + (" (it was excluded)" if me in excluded else
                                                         " (it was not selected)" if select is not None
                                                         else " (it checked in too late)"), members)
    # 4. The members' new communicator: the old hosts kept (simulated ones
    #    too), fresh keys, segment and inter-host group; the members' check-in
    #    records tell the bootstrap at once if one of them dies meanwhile.
    try:
        records = store.multi_get([f"alive/{r}" for r in members])
        known = {i: v.decode() for i, v in enumerate(records)}
    except Exception:  # noqa: BLE001 - the bootstrap below reports an unreachable Store
        known = {}
    try:
        new = _successor(comm, members.index(me), len(members), _successor_name(comm, epoch, f"@a{attempt}"), timeout,
                         members, known)
    except CommError as e:
        raise _as_lost(e, CommError(f"pycomm.shrink: building the communicator of ranks {members} failed ({e}); a "
                                    "member may have died meanwhile: call shrink() again")) from e
    logger.info("pycomm: rank %d shrank %r to ranks %s (epoch %d) in %.3f s", me, comm.name, members, epoch,
                time.monotonic() - t0)
    return new


def admit(comm: "Communicator", *, timeout: float = 30.0, multiple: int = 1,
          max_world_size: Optional[int] = None) -> "Communicator":
    """``comm`` grown by the processes waiting in :func:`join` (see the module's docstring).

    Collective over ``comm``'s members, all at the same point of their work.
    Returns ``comm`` itself when nobody waits; otherwise a new communicator of
    epoch ``comm.epoch + 1`` (members keep their ranks, ``parent_ranks`` is -1
    for each newcomer) and ``comm`` is fenced. Raises CommError on every member
    if the new communicator cannot be built within ``timeout`` (a newcomer or
    a member died meanwhile): ``comm`` stays fenced; shrink it. ``multiple``:
    admit newcomers only in groups of this many (whole pipeline replicas), in
    ticket order; the rest wait for the next call. ``max_world_size``: never
    grow past this many ranks (torchrun's ``--nnodes=MIN:MAX``): newcomers
    beyond it wait in :func:`join` as spares, in ticket order, and come in
    when a shrink has made room (a replacement for a rank that was taken for
    dead but came back waits so, instead of growing the job).

    Example: keep a job at 8 ranks; a spare stands by for the next failure::

        comm = elastic.admit(comm, max_world_size=8)
    """
    if multiple < 1:
        raise ValueError(f"pycomm.admit: multiple must be >= 1, got {multiple}")
    if max_world_size is not None and max_world_size < 1:
        raise ValueError(f"pycomm.admit: max_world_size must be >= 1 (or None: no bound), got {max_world_size}")
    root, me = comm._root_store, comm.rank
    js = _job_store(root, comm.job)
    k = getattr(comm, "_admit_calls", 0)
    comm._admit_calls = k + 1
    try:
        # 1. Propose the tickets taken so far, less those whose process this
        #    host sees dead (a replacement killed while it waited), as many
        #    as there is room for; one proposal wins. Without room, spares
        #    cost nothing: their fate is looked at once room is made.
        count = js.add("tickets", 0)
        taken = list(range(comm._admitted_upto + 1, count + 1))
        room = len(taken) if max_world_size is None else max(0, max_world_size - comm.world_size)
        records: Dict[int, str] = {}
        dead: set = set()
        if taken and room >= multiple:
            records = _ticket_records(js, taken)
            dead = {t for t in taken if t not in records or bootstrap.process_gone(records[t]) == "died"}
        live = [t for t in taken if t not in dead]
        chosen = live[:min(len(live), room) // multiple * multiple]
        # Dead tickets are passed over for good; live ones not chosen wait
        # (for a partner to make a whole replica, or for room).
        upto = chosen[-1] if chosen else comm._admitted_upto
        for t in taken:
            if t > upto:
                if t not in dead:
                    break
                upto = t
        proposal = dict(tickets=chosen, upto=upto)
        agreed = json.loads(_first_proposal(js, f"admit/{comm.name}/{k}", json.dumps(proposal)))
        tickets: List[int] = agreed["tickets"]
        skipped = sorted(set(range(comm._admitted_upto + 1, agreed["upto"] + 1)) - set(tickets))
        if skipped:
            logger.info("pycomm: rank %d: tickets %s of %r were not admitted: their processes died", me, skipped,
                        comm.job)
            if me == 0:  # one alive after all (frozen, or slow to publish its record) raises in join()
                for t in skipped:
                    js.set(f"admitted/{t}", json.dumps(dict(passed_over=True)))
        comm._admitted_upto = agreed["upto"]
        if not tickets:
            return comm
        # 2. Claim the agreed tickets, with the compare-and-set a newcomer
        #    whose join timed out withdraws its ticket with: one of the two
        #    holds, and every member reads the same outcome. A withdrawn
        #    newcomer would never come to the bootstrap (the members waited
        #    their whole timeout for it). If one withdrew, nobody comes in
        #    now: the others, claimed, are told to join again.
        withdrawn = [t for t in tickets if _claim(js, t, f"{comm.name}/{k}") == _WITHDRAWN]
        if withdrawn:
            logger.info("pycomm: rank %d: tickets %s of %r stopped waiting; admitting nobody now", me, withdrawn,
                        comm.job)
            if me == 0:
                for t in tickets:
                    if t not in withdrawn:
                        js.set(f"admitted/{t}", json.dumps(dict(passed_over=True)))
            return comm
        # 3. Tell each newcomer where it goes (one member writes; all read alike).
        world = comm.world_size + len(tickets)
        name = _successor_name(comm, comm.epoch + 1, f"+{k}")
        parents = list(range(comm.world_size)) + [-1] * len(tickets)
        if me == 0:
            for i, t in enumerate(tickets):
                js.set(f"admitted/{t}", json.dumps(dict(
                    name=name, rank=comm.world_size + i, world=world, epoch=comm.epoch + 1, kept=_kept(comm),
                    parent_ranks=parents, admitted_upto=agreed["upto"], settings=comm._settings)))
        # How this rank's bootstrap tells that a member or a newcomer died
        # before it started (a member killed during the admit would
        # otherwise hold the others for the whole timeout): the members'
        # records from their own bootstrap, and every admitted newcomer's,
        # also those whose record came after this rank's grace but before
        # the winning proposer's (that proposer read it, so it is there).
        known = _member_records(comm)
        for i, t in enumerate(tickets):
            known[comm.world_size + i] = records[t] if t in records else js.get(f"proc/{t}").decode()
    except CommError:
        raise
    except Exception as e:
        raise CommError(f"pycomm.admit: the Store cannot be reached ({type(e).__name__}: {e})") from e
    t0 = time.monotonic()
    _fence(comm, f"pycomm: communicator {comm.name!r} (epoch {comm.epoch}) was replaced by an admit; use the "
                 "communicator admit() returns", [])
    # 4. The communicator of epoch e+1, newcomers included.
    try:
        new = _successor(comm, me, world, name, timeout, parents, known)
    except CommError as e:
        raise _as_lost(e, CommError(f"pycomm.admit: building the communicator with newcomers {tickets} failed "
                                    f"({e}); a newcomer or a member may have died meanwhile: shrink() the old "
                                    "communicator")) from e
    logger.info("pycomm: rank %d admitted %d newcomer(s) into %r: world %d (epoch %d) in %.3f s", me, len(tickets),
                comm.job, world, new.epoch, time.monotonic() - t0)
    return new


def _waiting(comm: "Communicator") -> int:
    """How many tickets newcomers took since ``comm``'s last admission (one
    Store operation; a ticket of a newcomer that died or withdrew counts
    until an :func:`admit` passes it over)."""
    try:
        return int(_job_store(comm._root_store, comm.job).add("tickets", 0)) - comm._admitted_upto
    except Exception as e:
        raise CommError(f"pycomm.elastic: the Store cannot be reached ({type(e).__name__}: {e})") from e


def _member_records(comm: "Communicator") -> Dict[int, str]:
    """The process record each rank of ``comm`` published when it bootstrapped
    it (:func:`pycomm.bootstrap.process_record`), by rank."""
    keys = bootstrap.key_space(comm._root_store, comm.name)
    values = keys.multi_get([f"proc/{r}" for r in range(comm.world_size)])
    return {r: v.decode() for r, v in enumerate(values)}


def _ticket_records(js: "dist.Store", tickets: List[int]) -> Dict[int, str]:
    """The process record of each ticket that has one, waiting up to
    ``_RECORD_GRACE_S`` for those not published yet."""
    records: Dict[int, str] = {}
    deadline = time.monotonic() + _RECORD_GRACE_S
    while True:
        for t in tickets:
            if t not in records and js.check([f"proc/{t}"]):
                records[t] = js.get(f"proc/{t}").decode()
        if len(records) == len(tickets) or time.monotonic() >= deadline:
            return records
        time.sleep(0.01)


def join(store: "dist.Store", job: str, *, timeout: float = 300.0) -> "Communicator":
    """A communicator of the running job ``job``, once its members :func:`admit` this process.

    Args:
        store: the job's Store (the one its members bootstrapped from).
        job: the members' ``comm.job`` (their first communicator's name).
        timeout: seconds to wait for an admission, and for the bootstrap.

    Returns the communicator (``joined`` True, ``epoch`` the members'). Raises
    CommError if no member admits it within ``timeout``; its ticket is then
    withdrawn, so no admit takes it later, unless the members had just
    claimed it for an admission: then it waits for that (up to ``timeout``).
    """
    js = _job_store(store, job)
    try:
        ticket = js.add("tickets", 1)
        # How the members' admit and bootstrap tell that this process died.
        js.set(f"proc/{ticket}", bootstrap.process_record())
    except Exception as e:
        raise CommError(f"pycomm.join: the Store cannot be reached ({type(e).__name__}: {e})") from e
    key = f"admitted/{ticket}"
    try:
        js.wait([key], timedelta(seconds=timeout))
    except Exception as e:
        # Withdraw the ticket, unless the members claimed it for an admission
        # they agreed on: then they wait for this process, and it goes (its
        # admission, or word to join again, is written right after the claim).
        try:
            claimed = _claim(js, ticket, _WITHDRAWN) != _WITHDRAWN
            if claimed:
                js.wait([key], timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - the Store itself is gone: say what this process waited for
            claimed = False
        if not claimed:
            raise CommError(f"pycomm.join: job {job!r} did not admit this process (ticket {ticket}) within "
                            f"{timeout:g} s; its members admit newcomers when they call admit()") from e
    rec = json.loads(js.get(key).decode())
    if rec.get("passed_over"):
        raise CommError(f"pycomm.join: job {job!r} passed this process over (ticket {ticket}): it was taken for "
                        f"dead (no process record within {_RECORD_GRACE_S:g} s of its ticket, or its process "
                        "seen gone); join again")
    try:
        comm = _build(store, rec["rank"], rec["world"], rec["name"], timeout, None, rec["settings"],
                      rec["kept"]["heartbeat_timeout"], {})
    except CommError as e:
        raise CommError(f"pycomm.join: building the communicator of {job!r} failed ({e}); join again") from e
    _inherit(comm, job, rec["epoch"], rec["kept"], rec["parent_ranks"], rec["admitted_upto"])
    comm.joined = True
    logger.info("pycomm: joined %r as rank %d of %d (epoch %d)", job, comm.rank, comm.world_size, comm.epoch)
    return comm
