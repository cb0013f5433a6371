"""Hook futures of a process group's collectives, completed where no
``ProcessGroup`` destructor can wait for them.

A DDP comm hook must return a ``torch.futures.Future`` of the bucket's
tensor; the usual way (torch's own ``allreduce_hook``) is
``work.get_future().then(fn)``. Gloo completes a work's future on one of its
own threads, which runs ``fn`` there and, once the hook's future is already
complete, releases ``fn`` there: releasing a Python callable takes the GIL.
If the training process drops its last reference to the group at that moment
(``del ddp`` or ``destroy_process_group()`` right after a backward), the
main thread holds the GIL inside ``~ProcessGroupGloo``, which joins that very
thread: both wait forever. With ``sys.setswitchinterval(1.0)`` torch's
``allreduce_hook`` hangs so in most tries (tests/teardown_script.py).

So for such backends the hook's future is completed by a thread of pycomm's
that waits for the work (GIL released) and sets the result; no Python object
ever reaches the backend's threads. NCCL completes a CUDA work's future on the
caller's thread already (callbacks run inline, ordered by streams), so its
futures keep ``then``.

CUDA tensors (Gloo takes them through host memory): the serving thread waits
for the work with a stream of its own current (``work.wait()`` makes the
current stream wait for the collective's copies back to the device) and sets
the result of a CUDA-aware future there, which records an event on that
stream: whoever waits on the hook's future, on any stream, is ordered after
the data landed, without a device-wide synchronize. (A plain future, as
before, promised nothing to a waiter on another stream: ``StaleState`` read
a step-old average before Gloo's copy had written it in 1 of 3 runs on an
H100 and needed ``torch.cuda.synchronize``.)

A work of a group that was given up (``pycomm.elastic``'s epoch groups) may
complete only when a peer process exits, possibly while this process is
exiting too; a daemon thread that returns from ``work.wait()`` then, while
the interpreter finalizes, aborts the process (CPython ends such threads
with ``pthread_exit`` when they take the GIL back, which cannot unwind
through pybind's GIL guard: "terminate called without an active
exception"). ``GroupFutures(poll=True)`` waits by polling instead
(:func:`pycomm._lanes.wait_work`), so its thread sits in ``time.sleep``, which a
finalizing interpreter ends cleanly.

The same abort awaits a thread that is still inside the future's C++ when
the main thread, done with its last step, starts finalizing: ``set_result``
releases the GIL while it completes the future (and runs its callbacks), and
takes it back after the waiting main thread has already moved on. So at exit
every serving thread is stopped and joined (1 s for all together; a polling
thread still waiting for a given-up work is left to its ``sleep``).

Example::

    futures = GroupFutures()
    work = dist.all_reduce(t, group=pg, async_op=True)
    fut = futures.complete(work, lambda f: f.value()[0])   # a Future of t
"""
from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .._lanes import wait_work

Done = Callable[[torch.futures.Future], Any]


Job = Tuple[Any, Done, torch.futures.Future, Optional[torch.device]]

#: The last call of each thread that ended (see _serve).
_PARKED: list = []

#: (jobs, thread, polling) of each serving thread that may still run:
#: ``polling[0]`` is true while a polling thread waits for a work.
_LIVE: list = []

#: How long the exit waits for serving threads, all together.
_EXIT_JOIN_S = 1.0


def _join_at_exit() -> None:
    """Stops every serving thread and waits (GIL released) until it ended,
    so none is inside C++ when the interpreter finalizes (see above)."""
    live = [entry for entry in _LIVE if entry[1].is_alive()]
    for jobs, _, _ in live:
        jobs.put(None)
    deadline = time.monotonic() + _EXIT_JOIN_S
    for _, thread, polling in live:
        if not polling[0]:
            thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_at_exit)


def _serve(jobs: "queue.Queue[Optional[Job]]", poll: bool, polling: list) -> None:
    last = None
    streams: Dict[torch.device, Any] = {}  # this thread's stream per CUDA device
    while True:
        job = jobs.get()
        if job is None:
            # The last call's objects outlive this thread: freeing a Work
            # releases the GIL, which a thread ending at exit (the None that
            # weakref.finalize queues then) must not do, as above; and they
            # may hold the group, whose destructor this thread must not run.
            _PARKED.append(last)
            return
        last = None
        work, done, fut, device = last = job
        job = None
        try:
            if device is not None and device not in streams:
                streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(streams[device]) if device is not None else contextlib.nullcontext():
                polling[0] = poll
                try:
                    wait_work(work, poll)  # releases the GIL; raises the collective's error
                finally:
                    polling[0] = False
                # A CUDA-aware future records an event on this stream, which
                # has waited for the work: waiters' streams wait for it.
                fut.set_result(done(work.get_future()))
        except BaseException as e:  # noqa: BLE001 - DDP reports it from the hook's future
            fut.set_exception(e)


class GroupFutures:
    """Completes hook futures of a group's works in issue order, from one
    thread started at the first work and stopped when this object goes;
    ``poll``: waits by polling (a group that may be given up)."""

    def __init__(self, poll: bool = False) -> None:
        self.poll = poll
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def complete(self, work: Any, done: Done, device: Optional[torch.device] = None) -> torch.futures.Future:
        """A future of ``done(work.get_future())``, set once ``work`` finished
        (or of its error); CUDA-aware when ``device`` is a CUDA device (the
        result's), so that a waiter on any stream sees the data."""
        if self._thread is None:
            polling = [False]
            self._thread = threading.Thread(target=_serve, args=(self._jobs, self.poll, polling),
                                            name="pycomm-hook-futures", daemon=True)
            self._thread.start()
            _LIVE[:] = [entry for entry in _LIVE if entry[1].is_alive()]
            _LIVE.append((self._jobs, self._thread, polling))
            # The thread holds the queue, not this object: it ends when the
            # hook state that owns this object is collected.
            weakref.finalize(self, self._jobs.put, None)
        cuda = device is not None and torch.device(device).type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else None)
        self._jobs.put((work, done, fut, torch.device(device) if cuda else None))
        return fut

