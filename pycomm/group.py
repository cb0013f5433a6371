"""Compressed all-reduce over any ``torch.distributed`` group, on any device.

The same algorithm as :meth:`pycomm.Communicator.all_reduce` with
``compression=``, composed from pycomm's operators and the group's own
collectives instead of pycomm's transports, so it runs wherever the group
does: on GPUs over NCCL with everything on the device, on CPUs over Gloo.

* Int8 / Int4: quantize each rank's shard of (input + worker residual) →
  ``all_to_all_single`` of the payloads → dequantize, reduce in float32 in
  rank order, requantize with the server residual → all-gather (on Gloo,
  small shards by an all-to-all: one round instead of a ring) → dequantize.
* TopK: select (value, index) pairs from (input + residual) →
  all-gather of every rank's list → scatter-add in rank order
  into float32 → average → round once into the tensor's dtype.

Shard sizes, payload sizes, top-k entry counts and stochastic-rounding keys
come from the extension, so on the same inputs the result and the residuals
are the shared-memory compressed all-reduce's, bit for bit
(``tests/test_group.py`` checks it), and every rank gets the same bits.

Calls run in submission order on one worker thread per group and backend,
so the caller never blocks (DDP keeps computing backward) and every rank
issues the group's collectives in the same order; one call's all-gather
travels while the next call quantizes and exchanges. CUDA work runs on a
stream of that thread's own, ordered after the caller's current stream with
an event;
the returned future is CUDA-aware: waiting on it orders the waiter's stream
after the result (no host synchronisation), as NCCL's ``Work.get_future()``
does. Top-k reads the entry counts back to the host once per call.

Example::

    gc = pycomm.GroupCommunicator()               # over the default group's ranks
    ef = pycomm.compression.ErrorFeedback()
    gc.all_reduce(grad, op="avg", compression=pycomm.Int8(), error_feedback=ef, key="fc")
    work = gc.all_reduce(grad, op="avg", compression=pycomm.TopK(0.01), async_op=True)
    work.get_future().wait()
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import _env
from . import compression as _compression
from ._lanes import Lane, default_lane, device_backend, get_lane, stream_point, take_lanes
from ._loader import CommError, load_core

__all__ = ["GroupCommunicator", "GroupWork"]

_ALIGN = 64  # payload slots start 64-byte aligned, like the shared-memory path's
_COUNT_BYTES = 8  # the int64 entry count that leads each top-k slot
_MASK64 = (1 << 64) - 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_int64(u: int) -> int:
    """A uint64 key as the int64 the operators' schemas take (same bits)."""
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()

class GroupWork:
    """An asynchronous :meth:`GroupCommunicator.all_reduce`.

    ``get_future()`` completes with ``[output]`` once the work is enqueued on
    the device (CPU: done); ``wait()`` blocks until then and raises the call's
    error. ``bytes_sent`` / ``bytes_uncompressed`` are known at once,
    ``run_seconds`` once it completed.
    """

    def __init__(self, future: torch.futures.Future, bytes_sent: int, bytes_uncompressed: int) -> None:
        self._future = future
        self.bytes_sent = bytes_sent
        self.bytes_uncompressed = bytes_uncompressed
        self.run_seconds = 0.0

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class GroupCommunicator:
    """Compressed all-reduce over a private copy of a ``torch.distributed`` group.

    Args:
        process_group: whose ranks take part (default: the default group).
            Only those ranks create the communicator, each the same ones in
            the same order (the first call on a device creates a private group
            over them, collectively).
        store, rank, world_size: instead of a group's ranks, ranks
            ``0..world_size-1`` meeting on ``store`` (no default group
            needed): how :class:`pycomm.elastic.FaultTolerantDDP` builds one
            per membership epoch. ``process_group`` then only says the
            backend of CUDA tensors.
        backend: the private group's backend (default: :func:`device_backend`:
            Gloo for CPU tensors, the process group's NCCL for CUDA ones).
        timeout: seconds a collective of the private group may wait.

    The private group keeps this communicator's collectives, which run on a
    worker thread, from interleaving with the caller's own on
    ``process_group`` (NCCL and Gloo need every rank to issue a group's
    collectives in one order).

    Example::

        gc = pycomm.GroupCommunicator()
        gc.all_reduce(x, op="avg", compression=pycomm.Int4())
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 backend: Optional[str] = None, timeout: float = 300.0, store: Optional["dist.Store"] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        self._store = store
        self._own_lanes: Dict[str, tuple] = {}
        if store is not None:
            # Over a Store of its own (no default group needed): its lanes are
            # its own, keyed by this object, and go with abandon().
            if rank is None or world_size is None or not 0 <= int(rank) < int(world_size):
                raise CommError(f"pycomm.GroupCommunicator: with store=, pass rank= and world_size= (0 <= rank < "
                                f"world_size); got rank={rank}, world_size={world_size}")
            self.process_group = process_group
            self.rank, self.world_size = int(rank), int(world_size)
            self.ranks = list(range(self.world_size))
        else:
            if not dist.is_initialized():
                raise CommError("pycomm.GroupCommunicator: torch.distributed is not initialized "
                                "(call dist.init_process_group first, or pass store=, rank=, world_size=)")
            self.process_group = process_group if process_group is not None else dist.group.WORLD
            self.ranks = dist.get_process_group_ranks(self.process_group)
            me = dist.get_rank()
            if me not in self.ranks:
                raise CommError(f"pycomm.GroupCommunicator: rank {me} is not in the process group {self.ranks}")
            self.rank = self.ranks.index(me)
            self.world_size = len(self.ranks)
        self.backend = backend
        self.timeout = _env.check_seconds(timeout, "timeout")
        self._core = load_core()
        # Sequence numbers start and advance as the shared-memory
        # communicator's do (from 1; 2 per quantized call, 1 per top-k call):
        # they key stochastic rounding.
        self._seq = 1
        self._lock = threading.Lock()
        self._abandoned = False

    def lane_backend(self, device: torch.device) -> str:
        """The backend this communicator's collectives on ``device`` use."""
        if self.backend:
            return self.backend
        if self.process_group is None:  # over a Store, no group given
            return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
        return device_backend(self.process_group, device)

    def abandon(self) -> None:
        """Give up this communicator's own lanes (one built with ``store=``)
        without waiting for their calls in flight, which may wait on a peer
        that is gone: NCCL lanes are aborted, Gloo lanes end once their
        calls do. Calls made later raise."""
        self._abandoned = True  # first: a call from now on raises instead of making a new lane
        lanes = take_lanes(list(self._own_lanes.values()))
        self._own_lanes.clear()
        for lane in lanes:
            lane.abandon()

    def _lane(self, device: torch.device) -> Lane:
        backend = self.lane_backend(device)
        if self._store is None:
            return default_lane(self.ranks, backend, self.timeout)
        if self._abandoned:
            raise CommError("pycomm.GroupCommunicator: this communicator was abandoned (its group's membership "
                            "changed)")
        key = self._own_lanes.setdefault(backend, ("store", id(self), backend))
        return get_lane(key, lambda: Lane(dist.PrefixStore(f"{backend}/", self._store), self.rank, self.world_size,
                                        backend, self.timeout, poll=True))

    # ------------------------------------------------------------ public

    def compressed_shard_numel(self, numel: int, codec: "_compression.Codec") -> int:
        """Elements of this rank's reduced shard (its server residual's size; 0 for top-k)."""
        if not _compression.is_quantizer(codec):
            return 0
        return int(self._core.compressed_shard_elems(int(numel), self.world_size, int(codec.block)))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, compression: "_compression.Codec",
                   output: Optional[torch.Tensor] = None, async_op: bool = False,
                   error_feedback: Optional["_compression.ErrorFeedback"] = None,
                   key: Optional[Hashable] = None) -> Optional[GroupWork]:
        """Sum or average ``tensor`` over the group, sent compressed; the result
        lands in ``output`` (default: in place). Arguments as
        :meth:`pycomm.Communicator.all_reduce`.

        Example::

            work = gc.all_reduce(bucket, op="avg", compression=pycomm.Int8(), error_feedback=ef, key=0,
                                 async_op=True)
        """
        op = self._check(tensor, op, compression, output)
        out = tensor if output is None else output
        worker = server = None
        if error_feedback is not None:
            if key is None:
                key = tensor.data_ptr()
            worker, server = error_feedback.residuals(key, tensor, compression,
                                                      self.compressed_shard_numel(tensor.numel(), compression))
        quantized = _compression.is_quantizer(compression)
        with self._lock:  # one sequence and one queue order on every rank
            seq = self._seq
            self._seq += 2 if quantized else 1
            sent, plain = self._bytes(tensor, compression)
            fut = torch.futures.Future(devices=[tensor.device] if tensor.is_cuda else None)
            work = GroupWork(fut, sent, plain)
            run = self._quantized if quantized else self._sparse
            lane = self._lane(tensor.device)
            lane.queue.put(self._job(lane, run, work, fut, tensor, out, op, compression, worker, server, seq))
        if async_op:
            return work
        fut.wait()
        return None

    def __repr__(self) -> str:
        return f"GroupCommunicator(rank={self.rank}, world_size={self.world_size}, ranks={self.ranks})"

    # ------------------------------------------------------------ internals

    def _check(self, tensor, op, codec, output) -> str:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pycomm.GroupCommunicator.all_reduce: expected a tensor, got {type(tensor).__name__}")
        op = getattr(op, "name", op)
        op = str(op).lower() if op is not None else "sum"
        if op not in ("sum", "avg"):
            raise CommError(f"pycomm.GroupCommunicator.all_reduce: a compressed all-reduce sums or averages; "
                            f"op={op!r} is not supported")
        if not _compression.is_codec(codec):
            raise CommError(f"pycomm.GroupCommunicator.all_reduce: compression={codec!r} is not a codec; use "
                            "pycomm.Int8(), pycomm.Int4() or pycomm.TopK()")
        if tensor.dtype not in _compression.codec_dtypes():
            raise CommError(f"pycomm.GroupCommunicator.all_reduce: compression takes "
                            f"{', '.join(str(d) for d in _compression.codec_dtypes())}; got {tensor.dtype}")
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise CommError("pycomm.GroupCommunicator.all_reduce: the tensor must be dense and contiguous")
        if _capturing(tensor):
            raise CommError("pycomm.GroupCommunicator.all_reduce: cannot be captured in a CUDA graph (it runs on "
                            "a thread and stream of its own); call it outside the capture, or capture only the "
                            "model and run the hooks eagerly")
        if output is not None and (output.shape != tensor.shape or output.dtype != tensor.dtype
                                   or output.device != tensor.device or not output.is_contiguous()):
            raise CommError("pycomm.GroupCommunicator.all_reduce: output must be a contiguous tensor of the "
                            "input's shape, dtype and device")
        return op

    def _bytes(self, tensor, codec):
        n, w = tensor.numel(), self.world_size
        plain = _compression.plain_allreduce_bytes(n, tensor.element_size(), w)
        if _compression.is_quantizer(codec):
            shard = self.compressed_shard_numel(n, codec)
            return 2 * (w - 1) * _align(self._core.quant_payload_bytes(shard, codec.bits, codec.block)), plain
        _, cap = self._topk_sizes(n, codec)
        return (w - 1) * _align(_COUNT_BYTES + self._core.topk_payload_bytes(cap, tensor.element_size())), plain

    def _topk_sizes(self, n: int, codec):
        k = int(self._core.topk_entries(n, float(codec.ratio)))
        return k, int(self._core.topk_capacity(k, n, bool(codec.exact), float(codec.tolerance)))

    def _job(self, lane, run, work, fut, tensor, out, op, codec, worker, server, seq) -> Callable[[], Any]:
        """The call as the lane's thread runs it, in two parts: ``run`` is a
        generator that yields once its last collective is in flight; the job
        runs it that far and returns the rest, which the lane calls later.
        On CUDA both parts run on the lane's stream, after an event of the
        caller's stream."""
        ready = stream_point(tensor)

        def on_stream():
            if ready is None:
                return contextlib.nullcontext()
            stream = lane.stream(tensor.device)
            stack = contextlib.ExitStack()
            stack.enter_context(torch.cuda.device(tensor.device))
            stack.enter_context(torch.cuda.stream(stream))
            return stack

        def fail(e: BaseException) -> None:
            fut.set_exception(e if isinstance(e, (CommError, RuntimeError)) else CommError(str(e)))

        def start() -> Optional[Callable[[], None]]:
            t0 = time.perf_counter()
            try:
                with on_stream():
                    if ready is not None:
                        stream = torch.cuda.current_stream()
                        stream.wait_event(ready)
                        for t in (tensor, out, worker, server):
                            if t is not None:
                                t.record_stream(stream)  # the caller's allocations, used on our stream
                    steps = run(lane, tensor, out, op, codec, worker, server, seq, lane.calls % 2)
                    lane.calls += 1
                    next(steps, None)
            except BaseException as e:  # noqa: BLE001 - the waiter gets it
                fail(e)
                return None
            first = time.perf_counter() - t0

            def finish() -> None:
                t1 = time.perf_counter()
                try:
                    with on_stream():
                        for _ in steps:
                            pass
                        work.run_seconds = first + time.perf_counter() - t1
                        fut.set_result([out])  # on CUDA: records an event on our stream for whoever waits
                except BaseException as e:  # noqa: BLE001
                    fail(e)

            return finish

        return start

    def _seed(self, codec, seq: int, which: int) -> int:
        return _as_int64(self._core.rounding_seed(int(codec.seed) & _MASK64, seq, self.rank, which))

    def _quantized(self, lane, tensor, out, op, codec, worker, server, seq, parity):
        ops = torch.ops.pycomm
        n, w, me = tensor.numel(), self.world_size, self.rank
        bits, block, stoch = codec.bits, int(codec.block), bool(codec.stochastic)
        shard = self.compressed_shard_numel(n, codec)
        slot = _align(self._core.quant_payload_bytes(shard, bits, block))
        flat, dst = tensor.view(-1), out.view(-1)

        def span(q):
            lo = min(n, q * shard)
            return lo, min(n, lo + shard) - lo

        # 1. Quantize every shard of (input + worker residual) into the slot of
        #    the rank that reduces it; the residual keeps what rounding lost.
        dev = tensor.device
        with record_function("pycomm::compress"):
            send = lane.buffer("send", w * slot, dev)
            seed = self._seed(codec, seq, 0)
            for q in range(w):
                lo, ln = span(q)
                used = self._core.quant_payload_bytes(ln, bits, block)
                ops.quantize_into(flat[lo:lo + ln], send[q * slot:q * slot + used], bits, block, stoch, seed,
                                  None if worker is None else worker[lo:lo + ln], lo)
                send[q * slot + used:(q + 1) * slot].zero_()  # the alignment travels too: keep it deterministic
        # 2. Slot q goes to rank q; we get every rank's version of our shard.
        with record_function("pycomm::communicate"):
            recv = lane.buffer("recv", w * slot, dev)
            lane.all_to_all(recv, send)
        # 3. Reduce our shard in float32 in rank order, average if asked and
        #    requantize with the server residual, in one pass.
        with record_function("pycomm::reduce"):
            lo, ln = span(me)
            need = self._core.quant_payload_bytes(ln, bits, block)
            srcs = [recv[q * slot:q * slot + need] for q in range(w)]
            mine = lane.buffer(f"mine{parity}", slot, dev)
            ops.dequant_reduce_requant_into(mine[:need], srcs, None, ln, bits, block,
                                            1.0 / w if op == "avg" else 1.0, stoch, self._seed(codec, seq, 1),
                                            None if server is None else server[:ln], me * shard)
            mine[need:].zero_()
        # 4. Every rank's reduced shard, to every rank; the lane finishes the
        #    previous call while it travels.
        with record_function("pycomm::communicate"):
            gathered = lane.buffer(f"gathered{parity}", w * slot, dev)
            gather = lane.all_gather(gathered, mine, parity)
        yield
        lane.wait(gather)
        # 5. Every rank decodes the same bytes: the same result everywhere.
        with record_function("pycomm::decompress"):
            for q in range(w):
                lo, ln = span(q)
                if ln:
                    ops.dequantize_into(dst[lo:lo + ln], gathered[q * slot:(q + 1) * slot], bits, block)

    def _sparse(self, lane, tensor, out, op, codec, worker, server, seq, parity):
        ops = torch.ops.pycomm
        n, w = tensor.numel(), self.world_size
        es = tensor.element_size()
        k, cap = self._topk_sizes(n, codec)
        slot = _align(_COUNT_BYTES + self._core.topk_payload_bytes(cap, es))
        # 1. This rank's top-k of (input + residual); the residual keeps what is not sent.
        with record_function("pycomm::compress"):
            buf, kept, cap2 = ops.topk(tensor.view(-1), k, bool(codec.exact), float(codec.tolerance),
                                       float(codec.sample_fraction), self._seed(codec, seq, 2), worker)
            if cap2 != cap:
                raise CommError(f"pycomm.GroupCommunicator: top-k capacity {cap2} differs from the agreed {cap}")
            mine = lane.buffer(f"mine{parity}", slot, tensor.device)
            mine[:_COUNT_BYTES].copy_(torch.tensor([kept], dtype=torch.int64).view(torch.uint8))
            mine[_COUNT_BYTES:_COUNT_BYTES + buf.numel()].copy_(buf)
            mine[_COUNT_BYTES + buf.numel():].zero_()
        # 2. Everybody gets everybody's (value, index) list; the lane
        #    finishes the previous call while it travels.
        with record_function("pycomm::communicate"):
            gathered = lane.buffer(f"gathered{parity}", w * slot, tensor.device)
            gather = lane.all_gather(gathered, mine, parity)
        yield
        lane.wait(gather)
        # 3. Scatter-add the lists in rank order into float32, average, round once.
        with record_function("pycomm::decompress"):
            rows = gathered.view(w, slot)
            counts = rows[:, :_COUNT_BYTES].contiguous().view(torch.int64).view(-1).tolist()  # one read-back
            acc = lane.buffer("acc", 4 * n, tensor.device).view(torch.float32).zero_()
            for q, cnt in enumerate(counts):
                if not 0 <= cnt <= cap:
                    raise CommError(f"pycomm: rank {q} sent {cnt} top-k entries, more than the {cap} agreed on")
                ops.scatter_add(acc, *_compression.topk_entries(rows[q, _COUNT_BYTES:], cnt, cap, tensor.dtype))
            if op == "avg":
                acc.div_(w)
            out.view(-1).copy_(acc)
