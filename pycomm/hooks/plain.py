"""The plain hooks: buckets averaged uncompressed, or as 16-bit floats.

Example::

    ddp.register_comm_hook(hooks.AllReduceState(wire_dtype=torch.bfloat16), hooks.allreduce_hook)
"""
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import communicator as _communicator
from .. import default as _default
from .policy import Group, completed, sparse_average
from .state import HookState

_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class AllReduceState(HookState):
    """State of :func:`allreduce_hook`.

    Args:
        wire_dtype: ``None`` (send the gradients' own dtype), ``torch.bfloat16``
            or ``torch.float16``: cast before sending and back after (half the
            bytes of float32). pycomm accumulates 16-bit sums in float32.
        registered: keep each CPU bucket's copy in registered memory
            (:meth:`pycomm.Communicator.empty`, one buffer per bucket, made when
            DDP first sends it): the bucket is copied in on the backward
            thread, averaged in place (no staging copies), and copied back.
            The same number of full copies as the default, done as plain
            copies instead of inside the all-reduce; whether that is faster
            depends on the machine (benchmarks/RESULTS.md). Shared memory
            only (the communicator path); a bucket on another path ignores it.
        process_group, communicator: see :class:`HookState`.

    Example::

        ddp.register_comm_hook(hooks.AllReduceState(wire_dtype=torch.bfloat16), hooks.allreduce_hook)
    """

    def __init__(self, process_group: Group = None, *, wire_dtype: Optional[torch.dtype] = None,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None,
                 registered: bool = False) -> None:
        if wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"pycomm.hooks: wire_dtype={wire_dtype} is not supported; use None, torch.bfloat16 "
                             "or torch.float16")
        super().__init__(process_group, communicator=communicator, path=path)
        self.wire_dtype = wire_dtype
        self.registered = bool(registered)
        # Bucket index -> its registered copy (replaced when DDP rebuilds
        # its buckets and the size or dtype changes).
        self._registered: Dict[int, torch.Tensor] = {}

    def _registered_copy(self, index: int, wire: torch.Tensor) -> torch.Tensor:
        """``wire`` copied into this bucket's registered buffer (allocated on
        first use: every rank sends its buckets in one order, so every rank
        allocates alike)."""
        buf = self._registered.get(index)
        if buf is None or buf.numel() != wire.numel() or buf.dtype != wire.dtype:
            buf = self._registered[index] = self.communicator.empty(wire.numel(), dtype=wire.dtype)
        return buf.copy_(wire)


def _average(state: HookState, bucket: dist.GradBucket, wire_dtype: Optional[torch.dtype],
             name: str) -> torch.futures.Future[torch.Tensor]:
    """The bucket averaged over ranks, optionally sent as ``wire_dtype``, on
    the path the state's policy picks for it."""
    sparse = state._sparse_future(bucket)
    if sparse is not None:
        state._end_bucket(bucket)
        return sparse
    buf = bucket.buffer()
    cast = wire_dtype is not None and wire_dtype != buf.dtype and buf.is_floating_point()
    route = state._route(buf, compressed=False)
    with record_function(name):
        if cast:
            with record_function("pycomm::compress"):
                wire = buf.to(wire_dtype)
        else:
            wire = buf
        registered = route == "communicator" and getattr(state, "registered", False) and wire.device.type == "cpu"
        if registered:
            wire = state._registered_copy(bucket.index(), wire)
        if route == "ipc":
            work = state._ipc_group(buf.device).all_reduce(wire, op="avg", async_op=True)
        else:
            work = state._start_all_reduce(route, wire, "avg")
    uncompressed = state._plain_bytes(buf.numel(), 4 if buf.is_floating_point() else buf.element_size())
    sent = state._plain_bytes(wire.numel(), wire.element_size())

    def done(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()  # raises the collective's error, which DDP reports
        result = value[0] if isinstance(value, list) else value
        if cast:
            with record_function("pycomm::decompress"):
                buf.copy_(result)
            result = buf
        elif registered:
            buf.copy_(result)
            result = buf
        state._record(getattr(work, "run_seconds", 0.0), sent, uncompressed, compressed=cast)
        return result

    state._end_bucket(bucket)
    if route == "group":
        return state._group_future(work, done, buf.device)
    return work.get_future().then(done)


def _without_state(bucket: dist.GradBucket, wire_dtype: Optional[torch.dtype]) -> torch.futures.Future[torch.Tensor]:
    """A hook called with ``state=None``, as torch's default hooks take it:
    the default communicator (CPU buckets) or the default group's own
    all-reduce (CUDA buckets), optionally sent as ``wire_dtype``; no
    statistics."""
    buf = bucket.buffer()
    if buf.is_sparse and not buf.is_cuda:  # pycomm's communicator takes dense tensors
        return completed(sparse_average(_default.get_default(), buf))
    cast = wire_dtype is not None and wire_dtype != buf.dtype and buf.is_floating_point() and not buf.is_sparse
    wire = buf.to(wire_dtype) if cast else buf

    def done(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        result = value[0] if isinstance(value, list) else value
        if cast:
            buf.copy_(result)
            return buf
        return result

    if buf.is_cuda:  # as torch's allreduce_hook: the default group's own all-reduce
        wire.div_(dist.get_world_size())
        return dist.all_reduce(wire, async_op=True).get_future().then(done)
    return _default.get_default().all_reduce(wire, op="avg", async_op=True).get_future().then(done)


def _check_state(state: object, hook: str) -> None:
    if not isinstance(state, HookState):
        raise TypeError(f"pycomm.hooks.{hook}: state must be a pycomm.hooks.AllReduceState (or another pycomm hook "
                        f"state) or None, got {type(state).__name__} (for a process group, pass "
                        "AllReduceState(process_group))")


def allreduce_hook(state: Optional[AllReduceState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient bucket over ranks with pycomm's tuned all-reduce.

    ``state`` is an :class:`AllReduceState` (``wire_dtype`` picks a 16-bit
    wire format) or ``None`` for the default communicator without statistics.

    Example::

        ddp.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
    """
    if state is None:
        return _without_state(bucket, None)
    _check_state(state, "allreduce_hook")
    return _average(state, bucket, getattr(state, "wire_dtype", None), "pycomm::allreduce_hook")


def bf16_hook(state: Optional[HookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_hook` with bfloat16 on the wire, whatever the state says
    (pycomm's counterpart of PyTorch's ``bf16_compress_hook``; sums accumulate
    in float32). ``state=None``: the default communicator, as for
    :func:`allreduce_hook`.

    Example::

        ddp.register_comm_hook(None, hooks.bf16_hook)
    """
    if state is None:
        return _without_state(bucket, torch.bfloat16)
    _check_state(state, "bf16_hook")
    return _average(state, bucket, torch.bfloat16, "pycomm::bf16_hook")
