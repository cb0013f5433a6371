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

One-shot and two-shot calls (``algorithm="auto"`` too) may be captured in a
CUDA graph and replayed, as vLLM's custom all-reduce is used: their kernels
count their launches in device memory, so a replay is a new call on every
rank. Every rank must replay the same graphs in the same order, and a replay
that gave up is reported by :meth:`IpcAllReduce.check` (a replay has no host
step to raise from). The schedules and the compressed call count on the host
and refuse capture with a message.

Status: one-shot, two-shot, the schedules' executor and the bounded waits ran
on an H200 with 2-4 processes sharing the GPU (``tests/test_cuda.py``, bit for
bit against the CPU reduction and executor). Sharing one GPU without CUDA MPS,
a call waits for the peers' time slices (~4.5 ms), so the DDP hooks' policy
uses IPC only when every rank has a GPU of its own. :class:`pycomm.Communicator`
does not route CUDA tensors here.

Example::

    ipc = pycomm.cuda_ipc.IpcAllReduce(store, rank, world_size)
    x = torch.randn(1 << 20, device="cuda")
    ipc.all_reduce(x, op="avg")            # in place; the current stream waits for it
    ipc.all_reduce(x, algorithm="ring")    # the ring schedule, one kernel
    work = ipc.all_reduce(x, async_op=True)
    work.get_future().then(lambda f: ...)  # completed off the caller's thread
    ipc.check()                            # raises if a peer died or timed out

    g = torch.cuda.CUDAGraph()             # capture once, replay many times
    with torch.cuda.graph(g):
        ipc.all_reduce(x)
    g.replay()
    ipc.check()
"""
from __future__ import annotations

import functools
from typing import Callable, Hashable, Optional

import torch

from . import _env
from . import compression as _compression
from ._loader import CommError, load_core
from ._tables import REDUCE_OPS, CoreTable, Op, reduce_op_id
from .bootstrap import wait_keys

#: The IPC kernels by name ("auto", "one_shot", "two_shot", "ring", "tree",
#: "direct"; CUDA builds only).
IPC_ALGORITHMS = CoreTable("ipc_algorithms")
# Staging memory per rank: plain calls larger than this run in several
# launches; a compressed call must fit (its codes: about (world + 1) / world
# of a quarter (int8) or an eighth (int4) of a float32 tensor's bytes).
DEFAULT_BUFFER_BYTES = 64 << 20
_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=None)
def _ipc_ops() -> frozenset:
    """The reductions the IPC kernels take (what gradients need), as op ids
    (read from the extension on first use, not at import)."""
    return frozenset(REDUCE_OPS[n] for n in ("sum", "avg", "max", "min"))


def _fused_blocks_asked(fused_blocks: Optional[int]) -> int:
    """The fused blocks a rank asks for (0: as the GPU fits), from the
    argument or else ``PYCOMM_IPC_FUSED_BLOCKS`` (the extension refuses one
    out of range before the group meets its peers)."""
    if fused_blocks is not None:
        return fused_blocks
    return _env.whole("PYCOMM_IPC_FUSED_BLOCKS", 0, minimum=0)


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
        double_buffer: one-shot and two-shot calls stage into one half of
            the buffer or the other, alternately, and end without a barrier
            (the next call's start barrier covers it): one barrier fewer per
            one-shot call, half the buffer per launch; a call of another kind
            waits for the peers first. Every rank must pass the same.
        quantized_kernels: how compressed calls run: ``"fused"`` (default)
            as one kernel whose steps meet their peers' inside it, where the
            codec's block is 64, 128, 256 or 512 elements; ``"split"`` as a
            kernel per step with barriers between them (what other blocks
            always take). The same bits either way; every rank must pass
            the same.
        fused_blocks: the most thread blocks a launch of the fused kernel
            takes (1 to 512; default ``PYCOMM_IPC_FUSED_BLOCKS``, else 3 per SM
            shared by the ranks on one GPU). Ranks may differ: the group takes
            the least any rank asked for, and never more than 3 per SM
            (:attr:`fused_blocks` says how many). For measuring.
    """

    def __init__(self, store: "torch.distributed.Store", rank: int, world_size: int,
                 device: Optional[torch.device] = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 round_bytes: Optional[int] = None, prefix: str = "pycomm.ipc", timeout: float = 300.0,
                 quantized_kernels: str = "fused", double_buffer: bool = False,
                 fused_blocks: Optional[int] = None) -> None:
        if quantized_kernels not in ("fused", "split"):
            raise CommError(f"pycomm: quantized_kernels must be 'fused' or 'split', got {quantized_kernels!r}")
        fused_blocks = _fused_blocks_asked(fused_blocks)
        timeout = _env.check_seconds(timeout, "timeout")
        self._fused = quantized_kernels == "fused"
        core = load_core()
        if not core.has_cuda:
            raise CommError("pycomm: this build has no CUDA support (build with a CUDA torch and nvcc on the PATH)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        with torch.cuda.device(self.device):
            self._c = core.CudaIpcAllReduce(rank, world_size, buffer_bytes, round_bytes or 0, timeout,
                                            bool(double_buffer))
        self.rank, self.world_size = rank, world_size
        self._seq = 1  # the communicator's first sequence number (stochastic rounding keys)
        store.set(f"{prefix}/{rank}", self._c.handles(fused_blocks))
        keys = [f"{prefix}/{q}" for q in range(world_size)]
        wait_keys(store, keys, timeout, "every rank's CUDA IPC handles")
        with torch.cuda.device(self.device):
            self._c.open([store.get(k) for k in keys])
            self._stream = torch.cuda.Stream(self.device)
        self._side = (self._stream.stream_id, self._stream.device_index, self._stream.device_type)

    def all_reduce(self, tensor: torch.Tensor, op: Op = "sum", algorithm: str = "auto",
                   out: Optional[torch.Tensor] = None, async_op: bool = False, *,
                   compression: Optional["_compression.Codec"] = None,
                   error_feedback: Optional["_compression.ErrorFeedback"] = None,
                   key: Optional[Hashable] = None):
        """Reduces ``tensor`` over the group into ``out`` (default: in place).

        The kernels run on this group's own stream, ordered after the caller's
        current stream with an event, as NCCL's are. Synchronous calls then make
        the caller's stream wait for them (the CPU does not block) and return
        ``out``; ``async_op=True`` returns an :class:`IpcWork` instead. Every rank
        must call with the same size, dtype, op and algorithm, in the same order.

        ``compression=pycomm.Int8()`` or ``Int4()`` sends blockwise codes through
        the buffers instead (sum or avg of float32/float16/bfloat16 tensors): the
        communicator's compressed all-reduce, bit for bit, with its error
        feedback when ``error_feedback`` (and ``key``, as for
        :meth:`pycomm.Communicator.all_reduce`) is given.

        Example::

            ef = pycomm.compression.ErrorFeedback()
            ipc.all_reduce(grad, op="avg", compression=pycomm.Int8(), error_feedback=ef, key="grad")
        """
        if tensor.device != self.device:
            raise CommError(f"pycomm: tensor is on {tensor.device}, this IPC group on {self.device}")
        out = tensor if out is None else out
        if compression is not None:
            args = self._quantized_args(tensor, out, op, compression, error_feedback, key)
            if not async_op:
                # In one crossing into C++, as the plain calls below.
                self._c.quantized_all_reduce_sync(*args, self._fused, *self._side)
                return out
            return self._enqueue(self._quantized_launch(args), tensor, out, async_op, compression)
        op_id = reduce_op_id(op)
        # The IPC kernels reduce with sum, avg, max and min (what gradients need).
        if op_id is None or op_id not in _ipc_ops():
            raise CommError(f"pycomm: the CUDA IPC all-reduce takes op sum, avg, max or min, got {op!r}")
        if algorithm not in IPC_ALGORITHMS:
            raise CommError(f"pycomm: algorithm must be one of {', '.join(IPC_ALGORITHMS)}, got {algorithm!r}")
        algo = IPC_ALGORITHMS[algorithm]
        if not async_op:
            # _enqueue and IpcWork.wait in one crossing into C++: in Python
            # they cost tens of microseconds, most of a small call's time.
            self._c.all_reduce_sync(tensor, out, op_id, algo, *self._side)
            return out
        return self._enqueue(lambda: self._c.all_reduce(tensor, out, op_id, algo), tensor, out, async_op)

    def _quantized_args(self, tensor, out, op, codec, error_feedback, key) -> tuple:
        """Checks a compressed call and returns its arguments (the extension's
        quantized_all_reduce's, up to ``fused``)."""
        op_id = reduce_op_id(op)
        if op_id not in (REDUCE_OPS["sum"], REDUCE_OPS["avg"]):
            raise CommError(f"pycomm: a compressed CUDA IPC all-reduce sums or averages; op={op!r} is not supported")
        avg = op_id == REDUCE_OPS["avg"]
        if not _compression.is_quantizer(codec):
            raise CommError(f"pycomm: the CUDA IPC all-reduce compresses with pycomm.Int8() or pycomm.Int4(), got "
                            f"{codec!r} (top-k goes through pycomm.GroupCommunicator)")
        if tensor.dtype not in _compression.codec_dtypes():
            raise CommError(f"pycomm: compression takes {', '.join(str(d) for d in _compression.codec_dtypes())}; "
                            f"got {tensor.dtype}")
        if not tensor.is_contiguous() or out.shape != tensor.shape or out.dtype != tensor.dtype \
                or out.device != tensor.device or not out.is_contiguous():
            raise CommError("pycomm: the tensor and out must be contiguous, of one shape, dtype and device")
        n, bits, block = tensor.numel(), int(codec.bits), int(codec.block)
        if not self.fits(n, codec):
            need = self._c.quantized_bytes(n, bits, block)
            raise CommError(f"pycomm: a compressed CUDA IPC all-reduce of {n} elements needs {need} bytes of "
                            f"staging per rank; this group has {self._c.buffer_bytes} (make it with a larger "
                            "buffer_bytes)")
        worker = server = None
        if error_feedback is not None:
            worker, server = error_feedback.residuals(tensor.data_ptr() if key is None else key, tensor, codec,
                                                      self.compressed_shard_numel(n, codec))
        # The communicator's sequence numbers: a quantized call takes two.
        seq, self._seq = self._seq, self._seq + 2
        seeds = [load_core().rounding_seed(int(codec.seed) & _MASK64, seq, self.rank, which) for which in (0, 1)]
        return tensor, out, avg, bits, block, bool(codec.stochastic), seeds[0], seeds[1], worker, server

    def _quantized_launch(self, args: tuple) -> Callable[[], None]:
        """The launch of a compressed call on this group's stream (async_op)."""
        def launch() -> None:
            self._c.quantized_all_reduce(*args, self._fused)
            for r in args[-2:]:  # the residuals
                if r is not None:
                    r.record_stream(self._stream)
        return launch

    def compressed_shard_numel(self, numel: int, codec: "_compression.Codec") -> int:
        """Elements of this rank's shard (its server residual) in a compressed call."""
        return int(load_core().compressed_shard_elems(int(numel), self.world_size, int(codec.block)))

    def fits(self, numel: int, codec: "_compression.Codec") -> bool:
        """Whether a compressed call of ``numel`` elements fits this group's staging buffer."""
        return self._c.quantized_bytes(int(numel), int(codec.bits), int(codec.block)) <= self._c.buffer_bytes

    def _enqueue(self, launch: Callable[[], None], tensor: torch.Tensor, out: torch.Tensor, async_op: bool,
                 codec: Optional["_compression.Codec"] = None):
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._stream):
                launch()
        except BaseException:
            caller.wait_stream(self._stream)  # a refused call under capture: the capture must end joined
            raise
        # The caching allocator must not hand these tensors' memory to the
        # caller's stream before this stream is done with it.
        tensor.record_stream(self._stream)
        out.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        work = IpcWork(done, out, self._stream, self)
        # What this rank hands to its peers (they read it from its buffer):
        # the communicator's accounting of the same call.
        n, w = tensor.numel(), self.world_size
        work.bytes_uncompressed = _compression.plain_allreduce_bytes(n, tensor.element_size(), w)
        work.bytes_sent = (2 * (w - 1) * self._c.quantized_bytes(n, codec.bits, codec.block) // (w + 1)
                           if codec is not None else work.bytes_uncompressed)
        if async_op:
            return work
        work.wait()
        return out

    @property
    def buffer_bytes(self) -> int:
        """Staging bytes per rank."""
        return self._c.buffer_bytes

    @property
    def round_bytes(self) -> int:
        """The schedules' round size in bytes."""
        return self._c.round_bytes

    @property
    def blocks(self) -> int:
        """Thread blocks per launch: 36 for a rank alone on its GPU; ranks that
        share a GPU split 144 between them (at most 72 each), since every
        rank's blocks of a launch must be resident at once."""
        return self._c.blocks

    @property
    def fused_blocks(self) -> int:
        """Thread blocks per launch, at most, of the fused quantized all-reduce:
        3 per SM of the smallest GPU among the ranks, shared by the ranks on one
        GPU (a warp holds one quantization block, so it needs more warps than
        :attr:`blocks` gives), or fewer where ``fused_blocks`` (or
        ``PYCOMM_IPC_FUSED_BLOCKS``) asks (the least any rank asked). The same
        on every rank."""
        return self._c.fused_blocks

    def check(self) -> None:
        """Waits until this group's kernels issued so far are done, then raises
        :class:`~pycomm.CommError` if one of them gave up (a peer gone, or
        silent for ``timeout`` seconds): its result is not whole."""
        self._stream.synchronize()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raises CommError if a wait of this group's kernels gave up (read
        once the kernels in question are done)."""
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
        self.bytes_sent = self.bytes_uncompressed = 0
        self.run_seconds = 0.0  # (not measured: that would synchronize)

    def wait(self) -> bool:
        """Orders the current stream after the call; raises CommError where
        the call is already known to have given up (see ``synchronize``)."""
        torch.cuda.current_stream(self._result.device).wait_event(self._done)
        if not torch.cuda.is_current_stream_capturing() and self._done.query():
            self._group._raise_failure()
        return True

    def synchronize(self) -> None:
        """Blocks until the call is done; raises CommError if it gave up."""
        self._done.synchronize()
        self._group._raise_failure()

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
