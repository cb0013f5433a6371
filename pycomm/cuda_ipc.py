"""All-reduce of CUDA tensors among one host's processes through CUDA IPC.

Each rank registers one device staging buffer and a signal block once; ranks
exchange their IPC handles through the Store, and each all-reduce is one
kernel reading the peers' buffers: one-shot for small messages, two-shot
reduce-scatter + all-gather for large ones (as vLLM's custom all-reduce), or
one of pycomm's schedules, ``"ring"``, ``"tree"`` and ``"direct"``, run by a
device executor whose result is, bit for bit, the CPU communicator's with the
same algorithm and ``round_bytes``. Several ranks may share one GPU, which
NCCL refuses.

No call hangs on a dead peer: every wait in the kernels gives up after
``timeout`` seconds, and at once when a watchdog thread sees a peer's process
gone. The kernel then returns; :meth:`IpcAllReduce.check` (and every later
call) raises :class:`~pycomm.CommError` naming the peer, and the group cannot
be used again.

Status: one-shot and two-shot ran on one H100 with 2 and 4 processes sharing
the GPU (``tests/test_cuda.py``, bit for bit against the CPU reduction); the
schedules' executor and the bounded waits are compiled but have not run on a
GPU yet (their program runs on the CPU in CI). Sharing one GPU, a call waits
for the peers' time slices (~4.5 ms), so the DDP hooks' policy uses IPC only
when every rank has a GPU of its own. :class:`pycomm.Communicator` does not
route CUDA tensors here.

Example::

    ipc = pycomm.cuda_ipc.IpcAllReduce(store, rank, world_size)
    x = torch.randn(1 << 20, device="cuda")
    ipc.all_reduce(x, op="avg")            # in place; the current stream waits for it
    ipc.all_reduce(x, algorithm="ring")    # the ring schedule, one kernel
    work = ipc.all_reduce(x, async_op=True)
    work.get_future().then(lambda f: ...)  # completed off the caller's thread
    ipc.check()                            # raises if a peer died or timed out
"""
from __future__ import annotations

from typing import Optional

import torch

from ._loader import CommError, load_core
from ._tables import REDUCE_OPS, CoreTable, Op, reduce_op_id
from .bootstrap import wait_keys

#: The IPC kernels by name ("auto", "one_shot", "two_shot", "ring", "tree",
#: "direct"; CUDA builds only).
IPC_ALGORITHMS = CoreTable("ipc_algorithms")
# Staging memory per rank: calls larger than this run in several launches.
DEFAULT_BUFFER_BYTES = 64 << 20


class IpcAllReduce:
    """One IPC group: ``world_size`` processes of this host, any mix of GPUs.

    Args:
        store: a torch.distributed Store every rank reaches (handles travel there).
        rank, world_size: this process's place in the group (at most 8 ranks).
        device: the CUDA device of this rank's tensors (default: the current one).
        buffer_bytes: staging memory per rank; larger calls run in several launches.
        round_bytes: the round size of the schedules ("ring", "tree", "direct"):
            give a CPU communicator's ``round_bytes`` to get its bits; default
            (and most) a quarter of ``buffer_bytes``.
        prefix: Store key prefix, unique per group.
        timeout: seconds to wait for every rank's handles, and the most a
            kernel waits for a peer before it gives up.
    """

    def __init__(self, store: "torch.distributed.Store", rank: int, world_size: int,
                 device: Optional[torch.device] = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 round_bytes: Optional[int] = None, prefix: str = "pycomm.ipc", timeout: float = 300.0) -> None:
        core = load_core()
        if not core.has_cuda:
            raise CommError("pycomm: this build has no CUDA support (build with a CUDA torch and nvcc on the PATH)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        with torch.cuda.device(self.device):
            self._c = core.CudaIpcAllReduce(rank, world_size, buffer_bytes, round_bytes or 0, timeout)
        self.rank, self.world_size = rank, world_size
        store.set(f"{prefix}/{rank}", self._c.handles())
        keys = [f"{prefix}/{q}" for q in range(world_size)]
        wait_keys(store, keys, timeout, "every rank's CUDA IPC handles")
        with torch.cuda.device(self.device):
            self._c.open([store.get(k) for k in keys])
            self._stream = torch.cuda.Stream(self.device)

    def all_reduce(self, tensor: torch.Tensor, op: Op = "sum", algorithm: str = "auto",
                   out: Optional[torch.Tensor] = None, async_op: bool = False):
        """Reduces ``tensor`` over the group into ``out`` (default: in place).

        The kernels run on this group's own stream, ordered after the caller's
        current stream with an event, as NCCL's are. Synchronous calls then make
        the caller's stream wait for them (the CPU does not block) and return
        ``out``; ``async_op=True`` returns an :class:`IpcWork` instead. Every rank
        must call with the same size, dtype, op and algorithm, in the same order.
        """
        op_id = reduce_op_id(op)
        # The IPC kernels reduce with sum, avg, max and min (what gradients need).
        if op_id is None or op_id not in {REDUCE_OPS[n] for n in ("sum", "avg", "max", "min")}:
            raise CommError(f"pycomm: the CUDA IPC all-reduce takes op sum, avg, max or min, got {op!r}")
        if algorithm not in IPC_ALGORITHMS:
            raise CommError(f"pycomm: algorithm must be one of {', '.join(IPC_ALGORITHMS)}, got {algorithm!r}")
        if tensor.device != self.device:
            raise CommError(f"pycomm: tensor is on {tensor.device}, this IPC group on {self.device}")
        out = tensor if out is None else out
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            self._c.all_reduce(tensor, out, op_id, IPC_ALGORITHMS[algorithm])
        # The caching allocator must not hand these tensors' memory to the
        # caller's stream before this stream is done with it.
        tensor.record_stream(self._stream)
        out.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        work = IpcWork(done, out, self._stream, self)
        if async_op:
            return work
        work.wait()
        return out

    @property
    def round_bytes(self) -> int:
        """The schedules' round size in bytes."""
        return self._c.round_bytes

    def check(self) -> None:
        """Waits until this group's kernels issued so far are done, then raises
        :class:`~pycomm.CommError` if one of them gave up (a peer gone, or
        silent for ``timeout`` seconds): its result is not whole."""
        self._stream.synchronize()
        why = self._c.failure()
        if why:
            raise CommError(why)

    def abort(self, why: str = "aborted by the caller") -> None:
        """Makes every kernel of this group waiting on a peer give up now, and
        every later call raise."""
        self._c.abort(why)


class IpcWork:
    """Handle of an asynchronous IPC all-reduce (like a NCCL Work).

    ``wait()`` makes the current stream wait for the result without blocking
    the CPU; ``get_future()`` returns a CUDA-aware torch Future, already
    complete on the CPU side: whoever waits on it (or runs a ``then``
    callback) has its current stream ordered after the kernels, as with
    NCCL's ``Work.get_future()``; ``is_completed()`` polls.
    """

    def __init__(self, done: "torch.cuda.Event", result: torch.Tensor, stream: "torch.cuda.Stream",
                 group: IpcAllReduce) -> None:
        self._done, self._result, self._stream, self._group = done, result, stream, group
        self._future: Optional[torch.futures.Future] = None

    def wait(self) -> bool:
        """Orders the current stream after the call; raises CommError where
        the call is already known to have given up (see ``synchronize``)."""
        torch.cuda.current_stream(self._result.device).wait_event(self._done)
        if self._done.query():
            why = self._group._c.failure()
            if why:
                raise CommError(why)
        return True

    def synchronize(self) -> None:
        """Blocks until the call is done; raises CommError if it gave up."""
        self._done.synchronize()
        why = self._group._c.failure()
        if why:
            raise CommError(why)

    def is_completed(self) -> bool:
        return self._done.query()

    def result(self) -> torch.Tensor:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            fut: torch.futures.Future = torch.futures.Future(devices=[self._result.device])
            # set_result records an event on the current stream (the group's),
            # which every waiter's stream then waits for.
            with torch.cuda.stream(self._stream):
                fut.set_result(self._result)
            self._future = fut
        return self._future
