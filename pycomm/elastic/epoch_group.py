"""The process group of one membership epoch: how :class:`~pycomm.elastic.FaultTolerantDDP`
carries buckets on the group path (CUDA models over NCCL; CPU models over
Gloo with ``path="group"``) while ranks die and join.

A process group's membership is fixed, so every epoch gets one of its own,
built by its members over the Store keys of that epoch's communicator (fresh
keys: a rank fenced out of the epoch cannot connect to it), and the previous
epoch's is given up, as TorchFT reconfigures its groups. Compressed buckets
get a :class:`~pycomm.GroupCommunicator` over the same keys.

Gloo and NCCL learn of a dead peer from its closed connections, sometimes
only for the ranks it talked to, and of a frozen peer not at all before
their timeout. pycomm's communicator knows sooner (its heartbeat, the
liveness of its peers' processes). So while a step runs a thread of this
group asks the communicator every :data:`POLL_S` seconds; when the epoch
has failed, the buckets in flight are handed back to DDP untouched with the
failure remembered (as the communicator path does) and the group is given
up: NCCL aborted (which frees its kernels), Gloo shut down, both dropped by
a thread of their own. A call of this rank's group that failed aborts the
communicator as well (its peers of this host learn of it at once; the shrink
starts from there).

Example (what FaultTolerantDDP does at each change of membership)::

    group = EpochGroup(comm, torch.device("cuda", local_rank))
    state.process_group, state._group_comm = group.pg, group.group_comm
    fut = group.guard(hook(state, bucket), bucket.buffer(), failures)
    ...
    group.abandon()          # the next epoch's replaces it
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import queue
import socket
import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import bootstrap
from .._loader import CommError
from ..group import GroupCommunicator

logger = logging.getLogger("pycomm")

#: Seconds between two looks at the communicator while buckets are in
#: flight: far below the heartbeat bound (seconds) and recovery target
#: (1 s), and 50 looks a second cost nothing measurable.
POLL_S = 0.02

_Pending = Tuple[torch.futures.Future, torch.Tensor, List[BaseException]]


class EpochGroup:
    """A process group over the members of ``comm`` (one epoch), for
    tensors on ``device``: Gloo for CPU tensors, NCCL (the default backend)
    for CUDA ones. Building it is collective over ``comm``'s members.

    Attributes: ``pg`` (the group), ``group_comm`` (compressed all-reduce
    over it), ``cuda_backend`` ("nccl"; "gloo" where ranks share a GPU, which
    NCCL refuses; None for a CPU model), ``failed`` (why the epoch failed,
    or None).
    """

    def __init__(self, comm: Any, device: torch.device) -> None:
        self.comm, self.device = comm, device
        rank, size = comm.rank, comm.world_size
        delta = datetime.timedelta(seconds=comm.timeout)
        store = bootstrap.key_space(comm._root_store, comm.name, "epoch-group/")
        self.pg = dist.ProcessGroup(dist.PrefixStore("pg/", store), rank, size)
        gloo = _build_watched(comm, lambda: dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, delta))
        self._backends: List[Tuple[str, Any]] = [("gloo", gloo)]
        self.pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        default = dist.ProcessGroup.BackendType.GLOO
        self.cuda_backend = None if device.type != "cuda" else "gloo" if _shared_gpus(comm, device) else "nccl"
        if self.cuda_backend == "gloo":
            # Gloo takes CUDA tensors (through host memory).
            self.pg._register_backend(device, dist.ProcessGroup.BackendType.GLOO, gloo)
        elif self.cuda_backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = delta
            # Created lazily by NCCL at the first call; aborting it is what
            # frees a kernel that waits on a dead peer.
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
            self._backends.append(("nccl", nccl))
            self.pg._register_backend(device, dist.ProcessGroup.BackendType.NCCL, nccl)
            default = dist.ProcessGroup.BackendType.NCCL
        self.pg._set_default_backend(default)
        self.group_comm = GroupCommunicator(self.pg, store=dist.PrefixStore("lanes/", store), rank=rank,
                                            world_size=size, timeout=comm.timeout)
        self.failed: Optional[str] = None
        self._pending: Dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        self._active = 0  # steps under way (watched even with no bucket in flight)
        self._watch = threading.Thread(target=EpochGroup._watch_loop, args=(weakref.ref(self), self._wake),
                                       name="pycomm-epoch-watch", daemon=True)
        self._watch.start()

    def guard(self, fut: torch.futures.Future, buf: torch.Tensor,
              failures: List[BaseException]) -> torch.futures.Future:
        """The hook's future ``fut`` of bucket ``buf``, completed with ``buf``
        untouched (and the failure appended to ``failures``) if it fails or
        the epoch fails first."""
        out: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        with self._lock:
            failed = self.failed
            if failed is None:
                self._pending[id(out)] = (out, buf, failures)
                self._wake.notify()
        if failed is not None:
            failures.append(CommError(failed))
            out.set_result(buf)
            return out

        def settle(f: torch.futures.Future) -> None:
            try:
                value, error = f.value(), None
            except Exception as e:  # noqa: BLE001 - the group's error: this epoch is over
                value, error = buf, e
            with self._lock:
                mine = self._pending.pop(id(out), None) is not None
            if not mine:
                return  # the epoch's failure already handed the bucket back
            if error is not None:
                failures.append(error)
                self.fail(str(error))
            out.set_result(value)

        fut.add_done_callback(settle)
        return out

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch the communicator for the block (a training step), bucket in
        flight or not: a hook may wait inside DDP's backward for a call of
        an earlier step (``stale_hook``), which only shutting the group down
        frees."""
        with self._lock:
            self._active += 1
            self._wake.notify()
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def fail(self, why: str) -> None:
        """The epoch failed as this rank saw it (a hook raised, a call of the
        group failed): the same as the watch does, and the communicator is
        aborted so that peers of this host learn of it at once."""
        self._fail(f"pycomm.elastic: epoch {self.comm.epoch} failed: {why.splitlines()[0][:300]}", abort_comm=True)

    def abandon(self) -> None:
        """Give this group up (a new epoch replaces it): nothing waits for
        its calls in flight; they fail once it is shut down."""
        self._fail("pycomm.elastic: the membership changed; this epoch's group was given up", abort_comm=False)
        with self._lock:
            self._stopped = True
            self._wake.notify()

    # -------------------------------------------------------------- internals

    @staticmethod
    def _watch_loop(ref: "weakref.ref[EpochGroup]", wake: threading.Condition) -> None:
        # Holds the group weakly: a group its owner dropped without
        # abandon() ends this thread within a second instead of living on.
        while True:
            with wake:
                group = ref()
                if group is None or group._stopped:
                    return
                idle = not (group._pending or group._active)
                del group
                wake.wait(1.0 if idle else POLL_S)
                group = ref()
                if group is None or group._stopped or not (group._pending or group._active):
                    continue
            why = group._comm_failure()
            if why is not None:
                group._fail(why, abort_comm=False)
            del group

    def _comm_failure(self) -> Optional[str]:
        """Why the epoch failed, as the communicator knows it: ranks gone
        (dead, frozen, declared silent). Not its abort's reason: a member
        that finished the step may already have replaced the communicator
        (admitting newcomers) while this rank's last bucket, whose data has
        arrived, is still being completed."""
        try:
            gone = self.comm.gone_ranks()
        except CommError as e:  # closed meanwhile
            return str(e)
        if gone:
            return f"pycomm: rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of epoch " \
                   f"{self.comm.epoch} died or stopped responding"
        return None

    def _fail(self, why: str, *, abort_comm: bool) -> None:
        """Hand every bucket in flight back, abort the communicator (when the
        failure came from the group) and shut the group down, once."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = why
            pending, self._pending = list(self._pending.values()), {}
        logger.info("pycomm.elastic: rank %d: %s", self.comm.rank, why.splitlines()[0][:300])
        for out, buf, failures in pending:
            failures.append(CommError(why))
            out.set_result(buf)
        if abort_comm:
            try:
                self.comm.abort(why, name_rank=False)
            except CommError:
                pass
        self.group_comm.abandon()
        # Off this thread: closing Gloo's connections takes ~0.1 s, and the
        # group goes with that thread (no caller waits in its destructor).
        backends, self._backends = self._backends, []
        threading.Thread(target=_shut_down, args=(self.pg, backends), name="pycomm-epoch-shutdown",
                         daemon=True).start()


def _build_watched(comm: Any, make: Any) -> Any:
    """``make()`` (Gloo's constructor, which waits on the Store for every
    member's address) on a thread of its own while this one asks the
    communicator whether a member is gone: a member that dies meanwhile
    fails the build at once instead of at the Store's timeout (30 s in the
    chaos soak). The given-up build ends at that timeout, on its thread."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["pg"] = make()
        except Exception as e:  # noqa: BLE001 - raised below
            box["error"] = e

    t = threading.Thread(target=run, name="pycomm-epoch-build", daemon=True)
    t.start()
    while True:
        t.join(POLL_S)
        if not t.is_alive():
            break
        gone = comm.gone_ranks()
        if gone:
            raise CommError(f"pycomm.elastic: rank(s) {', '.join(map(str, gone))} died while epoch {comm.epoch}'s "
                            "group was being built")
    if "error" in box:
        raise CommError(f"pycomm.elastic: could not build epoch {comm.epoch}'s Gloo group ({box['error']})")
    return box["pg"]


def _shared_gpus(comm: Any, device: torch.device) -> Optional[str]:
    """Why NCCL cannot carry this epoch's CUDA tensors (ranks share a GPU,
    which NCCL refuses, or it is missing), or None; the same answer on every
    rank (one all-gather over ``comm``)."""
    props = torch.cuda.get_device_properties(device)
    ident = f"{socket.gethostname()}/{getattr(props, 'uuid', device)}"
    mine = torch.tensor([int.from_bytes(hashlib.sha256(ident.encode()).digest()[:8], "little", signed=True),
                         int(dist.is_nccl_available())], dtype=torch.int64)
    every = torch.empty(2 * comm.world_size, dtype=torch.int64)
    comm.all_gather(every, mine)
    rows = every.view(comm.world_size, 2).tolist()
    why = None
    if not all(r[1] for r in rows):
        why = "this torch has no NCCL on some rank"
    elif len({r[0] for r in rows}) < len(rows):
        why = "ranks share a GPU, which NCCL refuses"
    if why is not None and comm.rank == 0:
        logger.info("pycomm.elastic: epoch %d's CUDA buckets go over Gloo (through host memory): %s", comm.epoch, why)
    return why


def _shut_down(pg: Any, backends: List[Tuple[str, Any]]) -> None:
    for kind, backend in backends:
        try:
            backend.abort() if kind == "nccl" else backend.shutdown()
        except Exception as e:  # noqa: BLE001 - already broken: nothing left to close
            logger.debug("pycomm.elastic: shutting epoch group's %s down: %s", kind, e)
    _bury(pg, backends)


_GRAVES: "Optional[queue.Queue[Tuple[Any, List[Tuple[str, Any]]]]]" = None
_GRAVES_LOCK = threading.Lock()


def _bury(pg: Any, backends: List[Tuple[str, Any]]) -> None:
    """Hand a given-up group to the thread that drops it once nothing else
    holds it. ``~ProcessGroupGloo`` waits for the calls in flight, and one
    that waits on a peer that is gone (Gloo's shutdown does not free it)
    ends only at the group's timeout: no caller must be the one that drops
    the last reference (measured: 20 s stalls in 5 of 12 recoveries of
    ``stale_hook`` on the group path before this). Groups still held by
    that thread at exit are never destroyed (a daemon thread's objects are
    not)."""
    global _GRAVES
    with _GRAVES_LOCK:
        if _GRAVES is None:
            _GRAVES = queue.Queue()
            threading.Thread(target=_reap, args=(_GRAVES,), name="pycomm-epoch-reaper", daemon=True).start()
        _GRAVES.put((pg, backends))


def _reap(graves: "queue.Queue[Tuple[Any, List[Tuple[str, Any]]]]") -> None:
    held: List[Tuple[Any, List[Tuple[str, Any]]]] = []
    while True:
        try:
            held.append(graves.get(timeout=1.0))
        except queue.Empty:
            pass
        # Once only this list refers to a group (getrefcount: the list's
        # tuple and the call's argument), dropping it here is the last drop.
        keep = []
        for grave in held:
            (keep if sys.getrefcount(grave[0]) > 2 else []).append(grave)
        held = keep
