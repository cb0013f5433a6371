"""DDP communication hooks that send gradients through pycomm.

Register one on an existing ``DistributedDataParallel`` model, on any DDP
backend (gloo, nccl, pycomm)::

    import pycomm
    from pycomm import hooks

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)           # plain, float32
    ddp.register_comm_hook(hooks.AllReduceState(wire_dtype=torch.bfloat16), hooks.allreduce_hook)
    ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)  # or int4_hook
    ddp.register_comm_hook(hooks.CompressionState(codec=pycomm.TopK(0.01)), hooks.topk_hook)

Every hook has torch's signature ``hook(state, bucket) -> Future[Tensor]``:
it hands the bucket to pycomm's progress engine and returns at once; the
future completes on the progress thread, so backward keeps computing while
buckets travel. The future holds the bucket averaged over ranks (DDP does not
pre-divide). Each state keeps running statistics (:meth:`HookState.stats`),
and ``torch.profiler`` shows every bucket's ``pycomm::compress``,
``pycomm::communicate``, ``pycomm::reduce`` and ``pycomm::decompress`` ranges.

Compressed hooks keep error-feedback residuals per bucket, keyed by the
bucket's parameters: when DDP rebuilds its buckets after the first iteration
(or a bucket's layout changes), each parameter's residual moves to its new
place. Like PyTorch's PowerSGD hook they can start uncompressed for
``start_iter`` iterations.

Local SGD (periodic model averaging) is :class:`LocalSGD` (an optimizer
wrapper) together with :func:`local_sgd_hook`, which stops averaging
gradients after a warm-up.
"""
import logging
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import communicator as _communicator
from . import default as _default
from . import compression as _compression

logger = logging.getLogger("pycomm")

__all__ = [
    "AllReduceState",
    "CompressionState",
    "HookState",
    "LocalSGD",
    "LocalSGDState",
    "allreduce_hook",
    "bf16_hook",
    "compression_hook",
    "int4_hook",
    "int8_hook",
    "local_sgd_hook",
    "topk_hook",
]

Group = Union[None, dist.ProcessGroup, _communicator.Communicator]
_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def _resolve_communicator(process_group: Group, communicator: Optional["_communicator.Communicator"]):
    """The communicator a state uses: the one given, the default one (ranks of
    the default group), or a new one over ``process_group``'s ranks. Creating
    one is collective: build states on every rank, in the same order."""
    if communicator is not None and process_group is not None:
        raise ValueError("pycomm.hooks: pass process_group or communicator, not both")
    if isinstance(process_group, _communicator.Communicator):
        return process_group
    if communicator is not None:
        if not isinstance(communicator, _communicator.Communicator):
            raise TypeError(f"pycomm.hooks: communicator must be a pycomm.Communicator, got {type(communicator)}")
        return communicator
    if process_group is None or process_group is dist.group.WORLD:
        return _default.get_default()
    return _communicator.Communicator(process_group)


class HookState:
    """What every pycomm hook keeps: its communicator, the iteration count and
    running statistics.

    Args:
        process_group: the ranks DDP averages over; pass the group you gave
            DDP (default: the default group, served by pycomm's default
            communicator). A :class:`pycomm.Communicator` is accepted too.
        communicator: an existing communicator to share (instead of
            ``process_group``).

    Example::

        state = hooks.AllReduceState()
        ddp.register_comm_hook(state, hooks.allreduce_hook)
        ...
        print(state.stats())   # {'iterations': 100, 'bytes_sent': ..., 'comm_seconds': ...}
    """

    def __init__(self, process_group: Group = None, *,
                 communicator: Optional["_communicator.Communicator"] = None) -> None:
        self.communicator = _resolve_communicator(process_group, communicator)
        # Iterations DDP synchronized (no_sync() steps are not counted).
        self.iteration = 0
        self._lock = threading.Lock()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the running statistics (the iteration count stays)."""
        with self._lock:
            self._totals = {"buckets": 0, "compressed_buckets": 0, "bytes_sent": 0, "bytes_uncompressed": 0,
                            "comm_seconds": 0.0}

    def stats(self) -> Dict[str, float]:
        """Running totals over the buckets completed so far.

        ``bytes_sent`` is what this rank handed to its peers and
        ``bytes_uncompressed`` what a float32 all-reduce would have handed them
        (2(n-1)/n of the bucket), ``compression_ratio`` their quotient and
        ``comm_seconds`` the time pycomm's progress engine spent on the
        buckets (compression included, queueing excluded).
        """
        with self._lock:
            out: Dict[str, float] = dict(self._totals)
        out["iterations"] = self.iteration
        out["compression_ratio"] = out["bytes_uncompressed"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    # -------------------------------------------------------------- internals

    def _record(self, work: Any, sent: int, uncompressed: int, compressed: bool) -> None:
        with self._lock:
            t = self._totals
            t["buckets"] += 1
            t["compressed_buckets"] += int(compressed)
            t["bytes_sent"] += sent
            t["bytes_uncompressed"] += uncompressed
            t["comm_seconds"] += work.run_seconds

    def _plain_bytes(self, numel: int, element_size: int) -> int:
        world = self.communicator.world_size
        return 2 * (world - 1) * numel * element_size // world if world > 1 else 0

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iteration += 1


class AllReduceState(HookState):
    """State of :func:`allreduce_hook`.

    Args:
        wire_dtype: ``None`` (send the gradients' own dtype), ``torch.bfloat16``
            or ``torch.float16``: cast before sending and back after (half the
            bytes of float32). pycomm accumulates 16-bit sums in float32.
        process_group, communicator: see :class:`HookState`.

    Example::

        ddp.register_comm_hook(hooks.AllReduceState(wire_dtype=torch.bfloat16), hooks.allreduce_hook)
    """

    def __init__(self, process_group: Group = None, *, wire_dtype: Optional[torch.dtype] = None,
                 communicator: Optional["_communicator.Communicator"] = None) -> None:
        if wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"pycomm.hooks: wire_dtype={wire_dtype} is not supported; use None, torch.bfloat16 "
                             "or torch.float16")
        super().__init__(process_group, communicator=communicator)
        self.wire_dtype = wire_dtype


def _average(state: HookState, bucket: dist.GradBucket, wire_dtype: Optional[torch.dtype],
             name: str) -> torch.futures.Future[torch.Tensor]:
    """The bucket averaged over ranks, optionally sent as ``wire_dtype``."""
    comm = state.communicator
    buf = bucket.buffer()
    cast = wire_dtype is not None and wire_dtype != buf.dtype and buf.is_floating_point()
    with record_function(name):
        if cast:
            with record_function("pycomm::compress"):
                wire = buf.to(wire_dtype)
        else:
            wire = buf
        work = comm.all_reduce(wire, op="avg", async_op=True)
    uncompressed = state._plain_bytes(buf.numel(), 4 if buf.is_floating_point() else buf.element_size())
    sent = state._plain_bytes(wire.numel(), wire.element_size())

    def done(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]  # raises the collective's error, which DDP reports
        if cast:
            with record_function("pycomm::decompress"):
                buf.copy_(result)
            result = buf
        state._record(work, sent, uncompressed, compressed=cast)
        return result

    state._end_bucket(bucket)
    return work.get_future().then(done)


def allreduce_hook(state: Optional[AllReduceState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient bucket over ranks with pycomm's tuned all-reduce.

    ``state`` is an :class:`AllReduceState` (``wire_dtype`` picks a 16-bit
    wire format) or ``None`` for the default communicator without statistics.

    Example::

        ddp.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
    """
    if state is None:
        comm = _default.get_default()
        work = comm.all_reduce(bucket.buffer(), op="avg", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    if not isinstance(state, HookState):
        raise TypeError(f"pycomm.hooks.allreduce_hook: state must be a pycomm.hooks.AllReduceState or None, got "
                        f"{type(state).__name__} (for a process group, pass AllReduceState(process_group))")
    return _average(state, bucket, getattr(state, "wire_dtype", None), "pycomm::allreduce_hook")


def bf16_hook(state: Optional[HookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_hook` with bfloat16 on the wire, whatever the state says
    (pycomm's counterpart of PyTorch's ``bf16_compress_hook``; sums accumulate
    in float32)."""
    if state is None:
        raise TypeError("pycomm.hooks.bf16_hook: pass a pycomm.hooks.AllReduceState (or any pycomm hook state)")
    return _average(state, bucket, torch.bfloat16, "pycomm::bf16_hook")


# -------------------------------------------------------------- compression


class CompressionState(HookState):
    """State of the compressed hooks (:func:`int8_hook`, :func:`int4_hook`,
    :func:`topk_hook`, :func:`compression_hook`).

    Args:
        codec: :class:`pycomm.Int8`, :class:`pycomm.Int4` or
            :class:`pycomm.TopK` (default: the hook's own, e.g. ``Int8()`` for
            ``int8_hook``, ``TopK(0.01)`` for ``topk_hook``).
        start_iter: iterations sent uncompressed first (as PowerSGD's
            ``start_powerSGD_iter``): early gradients are large and change
            fast, and DDP rebuilds its buckets after the first iteration.
        error_feedback: carry what compression dropped into the next
            iteration's bucket (default on; without it top-k does not converge).
        process_group, communicator: see :class:`HookState`.

    Example::

        state = hooks.CompressionState(codec=pycomm.TopK(0.01), start_iter=10)
        ddp.register_comm_hook(state, hooks.topk_hook)
        ...
        state.stats()["compression_ratio"]     # about 45 for top-k 1 % on 4 ranks
    """

    def __init__(self, process_group: Group = None, codec: Optional[_compression.Codec] = None, *,
                 start_iter: int = 10, error_feedback: bool = True,
                 communicator: Optional["_communicator.Communicator"] = None) -> None:
        if codec is not None and not isinstance(codec, (_compression.Int8, _compression.Int4, _compression.TopK)):
            raise TypeError(f"pycomm.hooks: codec={codec!r} is not a codec; use pycomm.Int8(), pycomm.Int4() or "
                            "pycomm.TopK(ratio)")
        if int(start_iter) < 0:
            raise ValueError(f"pycomm.hooks: start_iter must be >= 0, got {start_iter}")
        super().__init__(process_group, communicator=communicator)
        self.codec = codec
        self.start_iter = int(start_iter)
        self.error_feedback: Optional[_compression.ErrorFeedback] = (
            _compression.ErrorFeedback() if error_feedback else None)
        # Where each parameter's slice of a bucket residual lives:
        # id(param) -> (bucket key, offset, numel). Rebuilt every iteration.
        self._homes: Dict[int, Tuple[Hashable, int, int]] = {}
        self._next_homes: Dict[int, Tuple[Hashable, int, int]] = {}
        self._used_keys: set = set()

    def _codec(self, want: Optional[type], default: Callable[[], _compression.Codec],
               hook: str) -> _compression.Codec:
        if self.codec is None:
            self.codec = default()
        elif want is not None and not isinstance(self.codec, want):
            raise TypeError(f"pycomm.hooks.{hook}: the state's codec is {self.codec!r}; {hook} needs a "
                            f"pycomm.{want.__name__} (or use compression_hook, which takes any codec)")
        return self.codec

    def _residual_key(self, bucket: dist.GradBucket, buf: torch.Tensor, codec: _compression.Codec) -> Hashable:
        """The bucket's error-feedback key, its residual carried over from the
        parameters' previous buckets when DDP rebuilt them."""
        params = bucket.parameters()
        key = (bucket.index(), tuple(id(p) for p in params))
        self._used_keys.add(key)
        ef = self.error_feedback
        assert ef is not None
        # Where this bucket's parameters sit: (offset, numel, previous home).
        layout, offset = [], 0
        for p in params:
            layout.append((offset, p.numel(), self._homes.get(id(p))))
            self._next_homes[id(p)] = (key, offset, p.numel())
            offset += p.numel()
        if ef.get(key) is None and any(home is not None for _, _, home in layout):
            # A rebuilt bucket: create its residual now (the all-reduce
            # would create it zero) and move each parameter's slice in. The
            # server residual belongs to another shard layout: it restarts
            # from zero, once.
            shard = self.communicator.compressed_shard_numel(buf.numel(), codec)
            worker, _ = ef.residuals(key, buf, codec, shard)
            for off, n, home in layout:
                old = ef.get(home[0]) if home is not None else None
                if old is not None and home[2] == n:
                    worker[off:off + n].copy_(old.worker[home[1]:home[1] + n])
        return key

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last() and self.error_feedback is not None and self._used_keys:
            # Residuals of buckets DDP no longer has (it rebuilt them) go.
            for key in [k for k in self.error_feedback.keys() if k not in self._used_keys]:
                self.error_feedback.reset(key)
            self._homes, self._next_homes = self._next_homes, {}
            self._used_keys = set()
        super()._end_bucket(bucket)


def _compressed(state: CompressionState, bucket: dist.GradBucket, want: Optional[type],
                default: Callable[[], _compression.Codec], hook: str) -> torch.futures.Future[torch.Tensor]:
    if not isinstance(state, CompressionState):
        raise TypeError(f"pycomm.hooks.{hook}: state must be a pycomm.hooks.CompressionState, got "
                        f"{type(state).__name__}")
    codec = state._codec(want, default, hook)
    buf = bucket.buffer()
    if state.iteration < state.start_iter or buf.dtype not in _compression.codec_dtypes():
        return _average(state, bucket, None, f"pycomm::{hook}")
    comm = state.communicator
    with record_function(f"pycomm::{hook}"):
        key = state._residual_key(bucket, buf, codec) if state.error_feedback is not None else None
        work = comm.all_reduce(buf, op="avg", compression=codec, error_feedback=state.error_feedback, key=key,
                               async_op=True)
    sent, uncompressed = work.bytes_sent, work.bytes_uncompressed

    def done(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]
        state._record(work, sent, uncompressed, compressed=True)
        return result

    state._end_bucket(bucket)
    return work.get_future().then(done)


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average buckets as blockwise int8 (about 1/4 of float32's bytes), with
    error feedback.

    Example::

        ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)
    """
    return _compressed(state, bucket, _compression.Int8, _compression.Int8, "int8_hook")


def int4_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average buckets as blockwise int4 (about 1/8 of float32's bytes), with
    error feedback."""
    return _compressed(state, bucket, _compression.Int4, _compression.Int4, "int4_hook")


def topk_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average buckets as each rank's top-k entries (``TopK(0.01)``: 1 %), with
    error feedback.

    Example::

        ddp.register_comm_hook(hooks.CompressionState(codec=pycomm.TopK(0.01)), hooks.topk_hook)
    """
    return _compressed(state, bucket, _compression.TopK, lambda: _compression.TopK(0.01), "topk_hook")


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average buckets through whichever codec ``state.codec`` holds (default Int8)."""
    return _compressed(state, bucket, None, _compression.Int8, "compression_hook")


# -------------------------------------------------------------- local SGD


class LocalSGDState(HookState):
    """State of :func:`local_sgd_hook`: gradients are averaged for
    ``start_iter`` iterations, then each rank steps on its own gradients and
    :class:`LocalSGD` averages the parameters every few steps.

    Example::

        state = hooks.LocalSGDState(start_iter=100)
        ddp.register_comm_hook(state, hooks.local_sgd_hook)
        opt = hooks.LocalSGD(torch.optim.SGD(ddp.parameters(), lr=0.1), period=4, warmup_steps=100)
    """

    def __init__(self, process_group: Group = None, *, start_iter: int = 0,
                 communicator: Optional["_communicator.Communicator"] = None) -> None:
        if int(start_iter) < 0:
            raise ValueError(f"pycomm.hooks: start_iter must be >= 0, got {start_iter}")
        super().__init__(process_group, communicator=communicator)
        self.start_iter = int(start_iter)


def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages gradients during the warm-up, then returns each rank's own."""
    if not isinstance(state, LocalSGDState):
        raise TypeError(f"pycomm.hooks.local_sgd_hook: state must be a pycomm.hooks.LocalSGDState, got "
                        f"{type(state).__name__}")
    if state.iteration < state.start_iter:
        return _average(state, bucket, None, "pycomm::local_sgd_hook")
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    state._end_bucket(bucket)
    return fut


class LocalSGD:
    """An optimizer wrapper that averages the parameters over ranks every
    ``period`` steps (local SGD / periodic model averaging).

    Step ``s`` (counting from 1) is followed by an average when
    ``s > warmup_steps`` and ``(s - warmup_steps) % period == 0``. Parameters
    of one dtype travel as one flat all-reduce (optionally compressed). Ranks
    should start from the same parameters (DDP broadcasts them; without DDP,
    call :meth:`average` once before training).

    Args:
        optimizer: the wrapped optimizer (its ``step``, ``zero_grad``,
            ``param_groups`` and state dict stay usable).
        period: steps between averages (>= 1).
        warmup_steps: steps before the first average (pair with
            :class:`LocalSGDState`'s ``start_iter``).
        process_group, communicator: see :class:`HookState`.
        compression: an optional codec for the averages.

    Example::

        opt = hooks.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=8)
        for x, y in data:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, period: int, *, warmup_steps: int = 0,
                 process_group: Group = None, communicator: Optional["_communicator.Communicator"] = None,
                 compression: Optional[_compression.Codec] = None) -> None:
        if int(period) < 1:
            raise ValueError(f"pycomm.hooks.LocalSGD: period must be >= 1, got {period}")
        if int(warmup_steps) < 0:
            raise ValueError(f"pycomm.hooks.LocalSGD: warmup_steps must be >= 0, got {warmup_steps}")
        self.optimizer = optimizer
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)
        self.communicator = _resolve_communicator(process_group, communicator)
        self.compression = compression
        self.step_count = 0
        self.averages = 0

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """The wrapped optimizer's step, then the parameter average when one is due."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.step_count += 1
        if self.step_count > self.warmup_steps and (self.step_count - self.warmup_steps) % self.period == 0:
            self.average()
        return loss

    @torch.no_grad()
    def average(self) -> None:
        """Average every parameter over ranks now (one flat all-reduce per dtype)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with record_function("pycomm::local_sgd_average"):
            self.communicator.all_reduce_coalesced(params, op="avg", compression=self.compression)
        self.averages += 1

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period}, warmup_steps={self.warmup_steps}, {self.optimizer!r})"

