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

Example::

    futures = GroupFutures()
    work = dist.all_reduce(t, group=pg, async_op=True)
    fut = futures.complete(work, lambda f: f.value()[0])   # a Future of t
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional, Tuple

import torch

Done = Callable[[torch.futures.Future], Any]


def _serve(jobs: "queue.Queue[Optional[Tuple[Any, Done, torch.futures.Future]]]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        work, done, fut = job
        try:
            work.wait()  # releases the GIL; raises the collective's error
            fut.set_result(done(work.get_future()))
        except BaseException as e:  # noqa: BLE001 - DDP reports it from the hook's future
            fut.set_exception(e)


class GroupFutures:
    """Completes hook futures of a group's works in issue order, from one
    thread started at the first work and stopped when this object goes."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[Tuple[Any, Done, torch.futures.Future]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def complete(self, work: Any, done: Done) -> torch.futures.Future:
        """A future of ``done(work.get_future())``, set once ``work`` finished
        (or of its error)."""
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="pycomm-hook-futures",
                                            daemon=True)
            self._thread.start()
            # The thread holds the queue, not this object: it ends when the
            # hook state that owns this object is collected.
            weakref.finalize(self, self._jobs.put, None)
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((work, done, fut))
        return fut

