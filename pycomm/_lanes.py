"""The lanes under :class:`pycomm.GroupCommunicator`: private groups, one worker thread each.

A lane is a private ``torch.distributed`` backend (Gloo or NCCL) over some
ranks, and the one thread that issues its collectives, shared by every
GroupCommunicator of those ranks and backend so that each rank issues them in
one order. This module holds the lanes, their registry (closed at exit), the
choice of backend by device, and the two stream and wait helpers that the
hooks share with the group path. :mod:`pycomm.group` holds the algorithm.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from ._loader import CommError

__all__ = ["GLOO_GATHER_BY_ALL_TO_ALL", "Lane", "default_lane", "device_backend", "get_lane", "stream_point",
           "take_lanes", "wait_work"]


def stream_point(tensor: torch.Tensor) -> Optional["torch.cuda.Event"]:
    """An event at the current end of ``tensor``'s current CUDA stream (None
    for a CPU tensor): work on another stream that waits for it comes after
    everything issued on this one so far."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


#: The largest block (bytes per rank) that the Gloo lanes all-gather by an
#: all-to-all: the same bytes as Gloo's all-gather, a ring of world - 1 hops
#: one after another, in one round. Between 4 hosts of the testbed at
#: 1 Gbit/s, idle: 0.9 ms instead of 3.7 ms for 1 KB, 1.5 instead of 4.2 ms for
#: 86 KB, equal at 256 KB; above that three flows per link at once ran slower
#: (an int4 all-reduce of 16M elements 10 % slower). See benchmarks/RESULTS.md.
GLOO_GATHER_BY_ALL_TO_ALL = 128 << 10

#: The longest sleep between two looks at a work that :func:`wait_work` polls.
POLL_MAX_S = 1e-3


def wait_work(work: Any, poll: bool = False) -> None:
    """``work.wait()`` (raises the collective's error); with ``poll``, first
    waits until ``work.is_completed()`` in sleeps from 20 us doubling up to
    :data:`POLL_MAX_S` (a call waited for costs at most ~1 ms more), see the
    :mod:`pycomm.hooks.futures` for why."""
    if poll:
        delay = 2e-5
        while not work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
    work.wait()


class Lane:
    """A private group over some ranks with one backend, and the one worker
    thread that issues its collectives: shared by every GroupCommunicator of
    those ranks and backend, so each rank issues them in one order.

    The backend is built directly over a Store (the default one, as
    pycomm's own point-to-point group is, or the one a GroupCommunicator was
    given), not through ``dist.new_group``: only the members take part, and
    torch's registry of groups is left alone.
    """

    def __init__(self, store: "dist.Store", me: int, size: int, backend: str, timeout: float,
                 poll: bool = False) -> None:
        delta = datetime.timedelta(seconds=timeout)
        self.nccl, self.size = backend == "nccl", size
        self.poll = poll  # wait for Gloo's works by polling (a lane that may be given up: futures.wait_work)
        if backend == "nccl":
            opts = _c10d.ProcessGroupNCCL.Options()
            opts._timeout = delta
            self.pg = _c10d.ProcessGroupNCCL(store, me, size, opts)
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, me, size, delta)
        else:
            raise CommError(f"pycomm.GroupCommunicator: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.pid = os.getpid()
        self.queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self.streams: Dict[int, Any] = {}
        self._buffers: Dict[Tuple[str, str], torch.Tensor] = {}
        self.calls = 0  # calls started: their parity picks the buffers two calls in flight must not share
        self.thread = threading.Thread(target=self._serve, name="pycomm-group", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        # Two calls in flight at most: a call's first part runs (up to its
        # last collective, left in flight), then the previous call is
        # finished. So one bucket's all-gather travels while the next
        # bucket quantizes and exchanges; with nothing queued, a call is
        # finished at once. Collectives are still issued in queue order.
        pending: Optional[Callable[[], None]] = None
        while True:
            try:
                job = self.queue.get(block=pending is None)
            except queue.Empty:
                pending()
                pending = None
                continue
            if job is None:
                if pending is not None:
                    pending()
                return
            finish = job()
            if pending is not None:
                pending()
            pending = finish

    def forked_copy(self) -> bool:
        """Whether this process is a fork() child of the one that made the
        lane. fork copies only the calling thread: the lane's thread and its
        backend's threads stayed with the parent, so a child can neither run
        its calls nor destroy its backend (``~ProcessGroupGloo`` would wait
        for those threads forever). The child keeps the backend until it
        exits, and its calls raise."""
        return os.getpid() != self.pid

    def refuse_in_fork(self) -> None:
        """Raises CommError in a fork() child (:meth:`forked_copy`)."""
        if self.forked_copy():
            raise CommError(f"pycomm.GroupCommunicator: its group belongs to process {self.pid}, and this process "
                            f"({os.getpid()}) is a fork() of it: fork copies only the calling thread, so the group's "
                            f"threads and its place among its peers stayed with process {self.pid}. Call it there; "
                            "start helper processes with multiprocessing's 'spawn' method, or let them exit without "
                            "calling it")

    def _keep_in_child(self) -> None:
        # One reference that is never dropped: the backend outlives the
        # interpreter's teardown, which would otherwise destroy it.
        if self.pg is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.pg))

    def close(self) -> None:
        """Finish the queued calls, stop the thread and release the backend."""
        if self.forked_copy():
            self._keep_in_child()
            return
        self.queue.put(None)
        self.thread.join()
        self._buffers.clear()
        pg, self.pg = self.pg, None
        del pg  # joins the backend's own threads now, not during interpreter teardown

    def abandon(self) -> None:
        """Stop after the queued calls without waiting for them (a peer may
        never answer them): the backend is aborted (NCCL) or its connections
        closed (Gloo), from a thread of its own (that takes ~0.1 s), so the
        calls in flight fail; then the lane's thread ends and the backend
        goes with it (no caller ever waits in its destructor)."""
        def shut(pg: Any) -> None:
            with contextlib.suppress(Exception):
                pg.abort() if self.nccl else pg.shutdown()

        if self.forked_copy():
            self._keep_in_child()
            return
        threading.Thread(target=shut, args=(self.pg,), name="pycomm-group-shutdown", daemon=True).start()
        self.queue.put(None)

    def buffer(self, role: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 scratch buffer of ``nbytes`` for ``role``, reused from call to
        call (grown when too small): steady-state calls touch no fresh pages,
        whose first-touch faults cost as much as the kernels. Only the lane's
        thread uses them, one call at a time (on CUDA, in its stream's order)."""
        key = (role, str(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[key] = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self.streams.get(idx)
        if s is None:
            s = self.streams[idx] = torch.cuda.Stream(device=idx)
        return s

    # Waiting orders the current stream after the collective (NCCL) or
    # returns once it is done (Gloo).
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.wait(self.pg.alltoall_base(out, inp, [], [], _c10d.AllToAllOptions()))

    def wait(self, work: Any) -> None:
        wait_work(work, self.poll and not self.nccl)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, parity: int):
        """Started, not waited for: returns the Work. On Gloo, blocks of up to
        :data:`GLOO_GATHER_BY_ALL_TO_ALL` bytes go by an all-to-all that
        sends ``inp`` to every rank (its send buffer is the call's:
        ``parity``, two calls may be in flight)."""
        if self.nccl:
            return self.pg._allgather_base(out, inp, _c10d.AllgatherOptions())
        if inp.numel() > GLOO_GATHER_BY_ALL_TO_ALL:
            return self.pg.allgather([list(out.chunk(self.size))], [inp])  # the list form takes CUDA tensors too
        send = self.buffer(f"gather-send{parity}", self.size * inp.numel(), inp.device)
        send.view(self.size, -1).copy_(inp.view(1, -1).expand(self.size, -1))
        return self.pg.alltoall_base(out, send, [], [], _c10d.AllToAllOptions())


_LANES: Dict[tuple, Lane] = {}
_LANES_LOCK = threading.Lock()


@atexit.register
def _close_lanes() -> None:
    with _LANES_LOCK:
        lanes = list(_LANES.values())
        _LANES.clear()
    for lane in lanes:
        lane.close()


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the lock at the fork.
    global _LANES_LOCK
    _LANES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_lane(key: tuple, make: Callable[[], Lane]) -> Lane:
    """The lane registered under ``key``, made by ``make()`` on first use.
    In a fork() child, a lane made before the fork raises instead
    (:meth:`Lane.refuse_in_fork`)."""
    with _LANES_LOCK:
        lane = _LANES.get(key)
        if lane is None:
            lane = _LANES[key] = make()
    lane.refuse_in_fork()
    return lane


def default_lane(ranks: List[int], backend: str, timeout: float) -> Lane:
    """The lane of ``ranks`` (global ranks) over the default Store."""
    from .bootstrap import restart_prefix

    def make() -> Lane:
        store = dist.PrefixStore(f"pycomm-lane/{restart_prefix()}{backend}/{'-'.join(map(str, ranks))}/",
                                 dist.distributed_c10d._get_default_store())
        return Lane(store, ranks.index(dist.get_rank()), len(ranks), backend, timeout)

    return get_lane((tuple(ranks), backend), make)


def device_backend(process_group: Optional[dist.ProcessGroup], device: torch.device) -> str:
    """The backend a private group uses for tensors on ``device``: Gloo for
    CPU tensors; for CUDA ones NCCL when ``process_group`` runs NCCL, else
    Gloo (which takes CUDA tensors, through host memory)."""
    if device.type != "cuda":
        return "gloo"
    pg = process_group if process_group is not None else dist.group.WORLD
    try:
        name = str(dist.get_backend(pg)).lower()
    except ValueError:  # a group built directly over a Store (pycomm.elastic's epoch groups)
        name = pg._get_backend_name().lower()
    return "nccl" if "nccl" in name else "gloo"


def take_lanes(keys: Iterable[tuple]) -> List[Lane]:
    """Unregisters the lanes under ``keys`` (those registered) and returns them:
    the caller closes or abandons them; a later :func:`get_lane` of a key makes a new one."""
    with _LANES_LOCK:
        return [_LANES.pop(key) for key in keys if key in _LANES]
