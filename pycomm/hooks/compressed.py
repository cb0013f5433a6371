"""The compressed hooks: int8, int4 and top-k buckets with error feedback,
whose residuals follow each parameter when DDP rebuilds its buckets.

Example::

    ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)
"""
import logging
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import communicator as _communicator
from .. import compression as _compression
from .plain import _average
from .policy import Group
from .state import HookState

logger = logging.getLogger("pycomm")


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
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        if codec is not None and not _compression.is_codec(codec):
            raise TypeError(f"pycomm.hooks: codec={codec!r} is not a codec; use pycomm.Int8(), pycomm.Int4() or "
                            "pycomm.TopK(ratio)")
        if int(start_iter) < 0:
            raise ValueError(f"pycomm.hooks: start_iter must be >= 0, got {start_iter}")
        super().__init__(process_group, communicator=communicator, path=path)
        self.codec = codec
        self.start_iter = int(start_iter)
        self.error_feedback: Optional[_compression.ErrorFeedback] = (
            _compression.ErrorFeedback() if error_feedback else None)
        # Where each parameter's slice of a bucket residual lives:
        # id(param) -> (bucket key, offset, numel). Rebuilt every iteration.
        self._homes: Dict[int, Tuple[Hashable, int, int]] = {}
        self._next_homes: Dict[int, Tuple[Hashable, int, int]] = {}
        self._used_keys: set = set()
        # From load_state_dict: worker residuals per parameter position, and
        # server residuals per (bucket index, parameter sizes).
        self._pending_params: List[Optional[torch.Tensor]] = []
        self._pending_server: Dict[Tuple[int, Tuple[int, ...]], torch.Tensor] = {}
        self._pending_world: Optional[int] = None  # the world size the server residuals come from
        self._warned_world = False

    def state_dict(self) -> Dict[str, Any]:
        """The iteration count and the error-feedback residuals: the worker
        residual per parameter (in the order of DDP's first iteration, so a
        fresh process finds each parameter's again whatever the bucket
        layout), the server residual per bucket (restored where the bucket
        holds the same parameters).

        Example::

            ckpt = {"model": ddp.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
        """
        out = super().state_dict()
        params: List[Optional[torch.Tensor]] = list(self._pending_params) or [None] * len(self._order)
        params += [None] * (len(self._order) - len(params))
        servers: Dict[Tuple[int, Tuple[int, ...]], torch.Tensor] = {}
        ef = self.error_feedback
        if ef is not None:
            for pos, pid in enumerate(self._order):
                home = self._homes.get(pid)
                res = ef.get(home[0]) if home is not None else None
                if res is not None:
                    params[pos] = res.worker[home[1]:home[1] + home[2]].detach().clone()
            for key in ef.keys():
                res = ef.get(key)
                if res.server is not None:
                    servers[(key[0], key[2])] = res.server.detach().clone()
        out["worker_residuals"] = params
        if servers or self._pending_server:
            # A server residual holds one shard of its bucket, and the shards
            # follow the world size: loaded ones not yet restored stay only
            # if they come from this one (_restore).
            out["world_size"] = world = self.world_size
            if self._pending_world in (None, world):
                servers = {**self._pending_server, **servers}
        out["server_residuals"] = servers
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: each residual goes back when its
        parameter's (or bucket's) next compressed all-reduce comes."""
        super().load_state_dict(state)
        if self.error_feedback is not None:
            self.error_feedback.reset()
        self._homes, self._next_homes, self._used_keys = {}, {}, set()
        self._pending_params = list(state.get("worker_residuals", []))
        self._pending_server = {(int(k[0]), tuple(k[1])): v for k, v in state.get("server_residuals", {}).items()}
        self._pending_world = state.get("world_size")

    def _codec(self, want: Optional[type], default: Callable[[], _compression.Codec],
               hook: str) -> _compression.Codec:
        if self.codec is None:
            self.codec = default()
        elif want is not None and not isinstance(self.codec, want):
            raise TypeError(f"pycomm.hooks.{hook}: the state's codec is {self.codec!r}; {hook} needs a "
                            f"pycomm.{want.__name__} (or use compression_hook, which takes any codec)")
        return self.codec

    def _residual_key(self, bucket: dist.GradBucket, buf: torch.Tensor, codec: _compression.Codec,
                      comm: Any) -> Hashable:
        """The bucket's error-feedback key, its residual carried over from the
        parameters' previous buckets when DDP rebuilt them (or from a loaded
        checkpoint)."""
        params = bucket.parameters()
        key = (bucket.index(), tuple(id(p) for p in params), tuple(p.numel() for p in params))
        self._used_keys.add(key)
        ef = self.error_feedback
        assert ef is not None
        # Where this bucket's parameters sit: (offset, numel, previous home).
        layout, offset = [], 0
        for p in params:
            layout.append((offset, p.numel(), self._homes.get(id(p))))
            self._next_homes[id(p)] = (key, offset, p.numel())
            offset += p.numel()
        rebuilt = any(home is not None for _, _, home in layout)
        if ef.get(key) is None and (rebuilt or self._pending_params or self._pending_server):
            # A new bucket with something to put in: create its residuals now
            # (the all-reduce would create them zero).
            worker, server = ef.residuals(key, buf, codec, comm.compressed_shard_numel(buf.numel(), codec))
            if rebuilt:
                # A rebuilt bucket: move each parameter's slice in. The server
                # residual belongs to another shard layout: it restarts from
                # zero, once.
                for off, n, home in layout:
                    old = ef.get(home[0]) if home is not None else None
                    if old is not None and home[2] == n:
                        worker[off:off + n].copy_(old.worker[home[1]:home[1] + n])
            else:
                self._restore(key, worker, server, layout, params, comm.world_size)
        return key

    def _restore(self, key, worker, server, layout, params, world: int) -> None:
        """Put a loaded checkpoint's residuals into a new bucket's. A server
        residual is one shard of its bucket: it goes back only into a job of
        the checkpoint's world size (at another, a shard of the same length
        can cover other elements)."""
        for (off, n, _), p in zip(layout, params):
            pos = self._position.get(id(p))
            saved = self._pending_params[pos] if pos is not None and pos < len(self._pending_params) else None
            if saved is not None:
                if saved.numel() == n:
                    worker[off:off + n].copy_(saved)
                else:
                    logger.warning("pycomm.hooks: the checkpoint's residual of parameter %d has %d elements, not %d; "
                                   "it restarts from zero", pos, saved.numel(), n)
                self._pending_params[pos] = None
        saved_server = self._pending_server.pop((key[0], key[2]), None)
        if saved_server is not None and self._pending_world not in (None, world):
            if not self._warned_world:
                self._warned_world = True
                logger.warning("pycomm.hooks: the checkpoint's server residuals come from %d ranks, this job has %d: "
                               "they restart from zero (the per-parameter worker residuals carry over)",
                               self._pending_world, world)
        elif server is not None and saved_server is not None and saved_server.numel() == server.numel():
            server.copy_(saved_server)
        if not any(t is not None for t in self._pending_params):
            self._pending_params = []

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
    state._observe(bucket)
    sparse = state._sparse_future(bucket)
    if sparse is not None:
        state._end_bucket(bucket)
        return sparse
    buf = bucket.buffer()
    if state.iteration < state.start_iter or buf.dtype not in _compression.codec_dtypes():
        return _average(state, bucket, None, f"pycomm::{hook}")
    route = state._route(buf, compressed=True, quantized=_compression.is_quantizer(codec))
    comm = state._compressed_path(route, buf, codec)
    with record_function(f"pycomm::{hook}"):
        key = state._residual_key(bucket, buf, codec, comm) if state.error_feedback is not None else None
        work = comm.all_reduce(buf, op="avg", compression=codec, error_feedback=state.error_feedback, key=key,
                               async_op=True)
    sent, uncompressed = work.bytes_sent, work.bytes_uncompressed

    def done(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()  # [output] from the communicator and the group path; IPC's is the output
        result = value[0] if isinstance(value, list) else value
        state._record(work.run_seconds, sent, uncompressed, compressed=True)
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
