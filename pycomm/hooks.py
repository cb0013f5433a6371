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

Which path a bucket takes (the policy; logged once per kind of bucket, at
INFO, with the reason):

* CPU buckets: pycomm's :class:`~pycomm.Communicator` (shared memory within a
  host, its inter-host transport between hosts).
* CUDA buckets, compressed: :class:`~pycomm.GroupCommunicator`, the same
  algorithm composed from pycomm's CUDA kernels and the group's own
  collectives (NCCL), everything on the device.
* CUDA buckets, plain (``allreduce_hook``, ``bf16_hook``): CUDA IPC when every
  rank is on one host, each on its own GPU; otherwise the group's own
  all-reduce.

``path=`` on a state (or the ``PYCOMM_HOOK_PATH`` environment variable)
forces ``"group"`` (any device; CPU buckets then go over Gloo), ``"ipc"``
(CUDA buckets) or ``"communicator"`` (CPU buckets).

GPU set-up (DDP on NCCL, gradients sent as int8)::

    dist.init_process_group("nccl")            # or "cpu:pycomm,cuda:nccl"
    ddp = DistributedDataParallel(model.cuda(), device_ids=[local_rank])
    ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)

Every state has ``state_dict()`` / ``load_state_dict()`` (iteration count and
error-feedback residuals) for checkpoints.
"""
import logging
import os
import socket
import threading
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import communicator as _communicator
from . import default as _default
from . import compression as _compression
from . import group as _group
from ._loader import CommError, load_core

logger = logging.getLogger("pycomm")

__all__ = [
    "AllReduceState",
    "CompressionState",
    "HookState",
    "LocalSGD",
    "LocalSGDState",
    "StaleState",
    "allreduce_hook",
    "bf16_hook",
    "compression_hook",
    "int4_hook",
    "int8_hook",
    "local_sgd_hook",
    "stale_hook",
    "topk_hook",
]

Group = Union[None, dist.ProcessGroup, _communicator.Communicator]
_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
#: What ``path=`` (or ``PYCOMM_HOOK_PATH``) may say.
PATHS = ("auto", "communicator", "group", "ipc")


def _given_communicator(process_group: Group, communicator: Optional["_communicator.Communicator"]
                        ) -> Optional["_communicator.Communicator"]:
    """The communicator the caller passed (as ``communicator`` or as
    ``process_group``), or None; raises on a bad pair."""
    if communicator is not None and process_group is not None:
        raise ValueError("pycomm.hooks: pass process_group or communicator, not both")
    if isinstance(process_group, _communicator.Communicator):
        return process_group
    if communicator is not None and not isinstance(communicator, _communicator.Communicator):
        raise TypeError(f"pycomm.hooks: communicator must be a pycomm.Communicator, got {type(communicator)}")
    return communicator


def _resolve_communicator(process_group: Group, communicator: Optional["_communicator.Communicator"]):
    """The communicator a state uses: the one given, the default one (ranks of
    the default group), or a new one over ``process_group``'s ranks. Creating
    one is collective: build states on every rank, in the same order."""
    given = _given_communicator(process_group, communicator)
    if given is not None:
        return given
    if process_group is None or process_group is dist.group.WORLD:
        return _default.get_default()
    return _communicator.Communicator(process_group)


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``value``: what a hook returns for a bucket
    it does not send."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def ipc_refusal(ranks: List[Tuple[str, str, bool]]) -> Optional[str]:
    """Why CUDA IPC cannot carry plain buckets among ``ranks`` (each rank's
    (host, GPU id, build has CUDA)), or None if it can."""
    if not all(r[2] for r in ranks):
        return "this pycomm build has no CUDA IPC on some rank"
    if len({r[0] for r in ranks}) > 1:
        return "the ranks span several hosts"
    if len({r[1] for r in ranks}) < len(ranks):
        return ("ranks share a GPU, so an IPC kernel waits for its peers' time slices (measured ~4.5 ms per "
                "call with 2 ranks on one H100)")
    if len(ranks) > 8:
        return "CUDA IPC groups have at most 8 ranks"
    return None


class HookState:
    """What every pycomm hook keeps: where buckets go, the iteration count
    and running statistics.

    Args:
        process_group: the ranks DDP averages over; pass the group you gave
            DDP (default: the default group, served by pycomm's default
            communicator). A :class:`pycomm.Communicator` is accepted too.
        communicator: an existing communicator to share (instead of
            ``process_group``).
        path: ``"auto"`` (the policy in :mod:`pycomm.hooks`), ``"group"``,
            ``"ipc"`` or ``"communicator"``; default: ``PYCOMM_HOOK_PATH`` or
            ``"auto"``.

    The communicator (CPU buckets) and the group and IPC paths (CUDA buckets)
    are set up at the first bucket that needs them, collectively: build
    states on every rank, in the same order.

    Example::

        state = hooks.AllReduceState()
        ddp.register_comm_hook(state, hooks.allreduce_hook)
        ...
        print(state.stats())   # {'iterations': 100, 'bytes_sent': ..., 'comm_seconds': ...}
    """

    def __init__(self, process_group: Group = None, *,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        self._comm_arg = _given_communicator(process_group, communicator)
        path = path or os.environ.get("PYCOMM_HOOK_PATH") or "auto"
        if path not in PATHS:
            raise ValueError(f"pycomm.hooks: path={path!r}; use one of {', '.join(PATHS)}")
        self.path = path
        self.process_group: Optional[dist.ProcessGroup] = (
            process_group if isinstance(process_group, dist.ProcessGroup) else None)
        self._communicator: Optional["_communicator.Communicator"] = self._comm_arg
        self._group_comm: Optional[_group.GroupCommunicator] = None
        self._ipc: Dict[torch.device, Any] = {}
        self._routes: Dict[Tuple[str, bool], str] = {}
        # Iterations DDP synchronized (no_sync() steps are not counted).
        self.iteration = 0
        self._lock = threading.Lock()
        self.reset_stats()

    @property
    def communicator(self) -> "_communicator.Communicator":
        """pycomm's communicator for CPU buckets (created on first use, collectively)."""
        if self._communicator is None:
            self._communicator = _resolve_communicator(self.process_group, None)
        return self._communicator

    @property
    def world_size(self) -> int:
        if self._comm_arg is not None:
            return self._comm_arg.world_size
        return dist.get_world_size(self.process_group) if dist.is_initialized() else self.communicator.world_size

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
        ``comm_seconds`` the time pycomm spent on the buckets (compression
        included, queueing excluded; 0 for buckets the group's own
        all-reduce or CUDA IPC carried, which run asynchronously on the GPU).
        """
        with self._lock:
            out: Dict[str, float] = dict(self._totals)
        out["iterations"] = self.iteration
        out["compression_ratio"] = out["bytes_uncompressed"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    def routes(self) -> Dict[str, str]:
        """The path each kind of bucket took so far, e.g. ``{"cuda/compressed": "group"}``."""
        return {f"{dev}/{'compressed' if c else 'plain'}": r for (dev, c), r in self._routes.items()}

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint needs to resume the hook as if never stopped.

        Example::

            torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)
            state.load_state_dict(torch.load(path)["hook"])
        """
        return {"iteration": self.iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])

    # -------------------------------------------------------------- internals

    def _record(self, seconds: float, sent: int, uncompressed: int, compressed: bool) -> None:
        with self._lock:
            t = self._totals
            t["buckets"] += 1
            t["compressed_buckets"] += int(compressed)
            t["bytes_sent"] += sent
            t["bytes_uncompressed"] += uncompressed
            t["comm_seconds"] += seconds

    def _plain_bytes(self, numel: int, element_size: int) -> int:
        return _compression.plain_allreduce_bytes(numel, element_size, self.world_size)

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iteration += 1

    # -------------------------------------------------------------- policy

    def _route(self, buf: torch.Tensor, compressed: bool) -> str:
        """The path of a bucket like ``buf``: decided once per device type and
        kind (collectively where it asks the peers), logged with its reason."""
        key = (buf.device.type, compressed)
        route = self._routes.get(key)
        if route is None:
            route, why = self._decide(buf, compressed)
            self._routes[key] = route
            logger.info("pycomm.hooks: %s %s buckets take the %s path: %s", buf.device.type,
                        "compressed" if compressed else "plain", route, why)
        return route

    def _decide(self, buf: torch.Tensor, compressed: bool) -> Tuple[str, str]:
        forced = f"path={self.path!r} was asked for"
        if buf.device.type == "cpu":
            if self.path == "ipc":
                raise CommError("pycomm.hooks: path='ipc' takes CUDA buckets; this bucket is on the CPU")
            if self.path == "group":
                return "group", forced + " (Gloo)"
            return "communicator", "CPU tensors go through pycomm's communicator (shared memory within a host)"
        if buf.device.type != "cuda":
            raise CommError(f"pycomm.hooks: buckets on {buf.device} are not supported (CPU and CUDA are)")
        if self.path == "communicator" or self._comm_arg is not None:
            raise CommError("pycomm.hooks: pycomm's communicator takes CPU tensors only; for CUDA buckets build "
                            "the state with the DDP process group (or none), not a communicator, and path='auto'")
        backend = _group.device_backend(self.process_group, buf.device)
        if compressed:
            return "group", (forced if self.path == "group" else "compressed CUDA buckets are composed from "
                             f"pycomm's CUDA kernels and the group's own collectives ({backend}), on the device")
        if self.path in ("group", "ipc"):
            return self.path, forced
        why_not = self._ipc_refusal(buf.device)
        if why_not is None:
            return "ipc", "every rank is on this host, each on its own GPU: CUDA IPC (one kernel per call)"
        return "group", f"the group's own all-reduce ({backend}): {why_not}"

    def _ipc_refusal(self, device: torch.device) -> Optional[str]:
        """Why CUDA IPC cannot carry this group's plain buckets, or None if it
        can; the same answer on every rank (it asks them all)."""
        props = torch.cuda.get_device_properties(device)
        gpu = str(props.uuid) if hasattr(props, "uuid") else f"{socket.gethostname()}/{device}"
        mine = (socket.gethostname(), gpu, bool(getattr(load_core(), "has_cuda", False)))
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        return ipc_refusal(everyone)

    def _group_communicator(self) -> _group.GroupCommunicator:
        if self._group_comm is None:
            pg = self.process_group
            if self._comm_arg is not None:
                raise CommError("pycomm.hooks: path='group' needs the DDP process group; build the state with "
                                "process_group=, not communicator=")
            self._group_comm = _group.GroupCommunicator(pg)
        return self._group_comm

    def _ipc_group(self, device: torch.device):
        ipc = self._ipc.get(device)
        if ipc is None:
            from . import cuda_ipc

            pg = self.process_group if self.process_group is not None else dist.group.WORLD
            store = dist.distributed_c10d._get_default_store()
            ranks = "-".join(map(str, dist.get_process_group_ranks(pg)))
            world = dist.get_world_size(pg)
            # The n-th IPC group of these ranks: every rank counts itself in;
            # none counts for the next group before all counted for this one,
            # since building a group waits for every rank's handles.
            n = (store.add(f"pycomm.hooks.ipc/{ranks}/count", 1) - 1) // world
            ipc = self._ipc[device] = cuda_ipc.IpcAllReduce(store, dist.get_rank(pg), world, device=device,
                                                            prefix=f"pycomm.hooks.ipc/{ranks}/{n}")
        return ipc


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
        if route == "communicator":
            work = state.communicator.all_reduce(wire, op="avg", async_op=True)
        elif route == "ipc":
            work = state._ipc_group(buf.device).all_reduce(wire, op="avg", async_op=True)
        else:  # the group's own all-reduce; Gloo has no AVG, so divide first (as torch's allreduce_hook)
            wire.div_(state.world_size)
            work = dist.all_reduce(wire, group=state.process_group, async_op=True)
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
    return work.get_future().then(done)


def allreduce_hook(state: Optional[AllReduceState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient bucket over ranks with pycomm's tuned all-reduce.

    ``state`` is an :class:`AllReduceState` (``wire_dtype`` picks a 16-bit
    wire format) or ``None`` for the default communicator without statistics.

    Example::

        ddp.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
    """
    if state is None:
        buf = bucket.buffer()
        if buf.is_cuda:  # as torch's allreduce_hook: the default group's own all-reduce
            buf.div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])
        work = _default.get_default().all_reduce(buf, op="avg", async_op=True)
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
        # Parameters in the order of the first iteration this state saw (DDP's
        # initial bucket layout, the same in every fresh process): how a
        # checkpoint names them.
        self._order: List[int] = []
        self._position: Dict[int, int] = {}
        self._order_done = False
        # From load_state_dict: worker residuals per parameter position, and
        # server residuals per (bucket index, parameter sizes).
        self._pending_params: List[Optional[torch.Tensor]] = []
        self._pending_server: Dict[Tuple[int, Tuple[int, ...]], torch.Tensor] = {}

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
        servers = dict(self._pending_server)
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

    def _observe(self, bucket: dist.GradBucket) -> None:
        if self._order_done:
            return
        for p in bucket.parameters():
            if id(p) not in self._position:
                self._position[id(p)] = len(self._order)
                self._order.append(id(p))
        self._order_done = bucket.is_last()

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
                self._restore(key, worker, server, layout, params)
        return key

    def _restore(self, key, worker, server, layout, params) -> None:
        """Put a loaded checkpoint's residuals into a new bucket's."""
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
        if server is not None and saved_server is not None and saved_server.numel() == server.numel():
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
    buf = bucket.buffer()
    state._observe(bucket)
    if state.iteration < state.start_iter or buf.dtype not in _compression.codec_dtypes():
        return _average(state, bucket, None, f"pycomm::{hook}")
    route = state._route(buf, compressed=True)
    comm = state.communicator if route == "communicator" else state._group_communicator()
    with record_function(f"pycomm::{hook}"):
        key = state._residual_key(bucket, buf, codec, comm) if state.error_feedback is not None else None
        work = comm.all_reduce(buf, op="avg", compression=codec, error_feedback=state.error_feedback, key=key,
                               async_op=True)
    sent, uncompressed = work.bytes_sent, work.bytes_uncompressed

    def done(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]
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


# -------------------------------------------------------------- bounded staleness


class _Snapshot:
    """What a hook reads of a bucket (its buffer, parameters, index, whether
    it is the last), with the buffer replaced by a copy: a stale all-reduce
    keeps travelling after DDP has reused the bucket's own buffer."""

    def __init__(self, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
        self._buf, self._index, self._last = buf, bucket.index(), bucket.is_last()
        self._params = bucket.parameters()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> List[torch.Tensor]:
        return self._params


class _InFlight:
    """One bucket's average on its way: the future, the parameters it holds
    and where each sits in the flat bucket."""

    def __init__(self, params: List[torch.Tensor], future: torch.futures.Future) -> None:
        self.params, self.future = params, future
        self.ids = tuple(id(p) for p in params)
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()


class StaleState(HookState):
    """State of :func:`stale_hook`: bounded-staleness gradient averaging.

    Every bucket's average starts at once and keeps travelling behind the
    next ``staleness`` forwards and backwards; the gradients a step applies
    are the average of the ones computed ``staleness`` steps earlier. With
    :math:`s` the staleness, :math:`g^i_t` rank :math:`i`'s gradient at step
    :math:`t` (computed at the parameters :math:`w_t`) and :math:`A` the wire
    format's average (exact for float32, quantized with error feedback for
    int8/int4/top-k)::

        w_{t+1} = w_t - lr * A(g^0_{t-s}, ..., g^{n-1}_{t-s})     for t >= s
        w_{t+1} = w_t - lr * 0                                    for t <  s

    (written for SGD; any optimizer receives ``A(...)`` as the gradient).
    The first ``staleness`` steps therefore apply zero gradients (no average
    has arrived yet; with weight decay or momentum the optimizer still moves:
    check :attr:`has_update` to skip its step), and :meth:`flush` applies the
    last ``staleness`` averages at the end, so every gradient is applied
    exactly once. This is delayed-gradient SGD (Agarwal & Duchi, "Distributed
    delayed stochastic optimization", 2011), the bounded staleness of stale
    synchronous parallel (Ho et al., 2013) with every rank at the same clock,
    and the delayed averaging of DaSGD (Zhou et al., 2020) without its local
    step: parameters stay bitwise identical on every rank, and the step's
    communication hides entirely behind the next step's computation as long
    as it is shorter.

    A delay acts like extra momentum (Mitliagkas et al., "Asynchrony begets
    momentum", 2016): a recipe at the edge of stability needs a smaller
    learning rate or momentum. Measured on digits (4 ranks, 500 steps, SGD
    with momentum 0.9, cosine decay): at lr 0.05 staleness 1 matches
    synchronous averaging (97.3-97.8 % against 96.7-97.3 %); at lr 0.1 it
    falls to 87-92 % against 98 %; staleness 2 diverges at lr 0.1 and
    reaches 94-96 % at lr 0.025 (synchronous 96-97 %).

    Args:
        staleness: ``s >= 1``, steps between computing a gradient and applying
            its average.
        wire: how buckets travel: ``None`` (their own dtype), ``torch.bfloat16``
            or ``torch.float16``, or a codec (:class:`pycomm.Int8`,
            :class:`pycomm.Int4`, :class:`pycomm.TopK`), compressed from the
            first step with error feedback.
        process_group, communicator, path: see :class:`HookState`.

    Example::

        state = hooks.StaleState(staleness=1, wire=pycomm.Int8())
        ddp.register_comm_hook(state, hooks.stale_hook)
        for x, y in data:
            opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
        for _ in state.flush():          # the last averages still in flight
            opt.step()
    """

    def __init__(self, process_group: Group = None, *, staleness: int = 1,
                 wire: Union[None, torch.dtype, _compression.Codec] = None,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"pycomm.hooks.StaleState: staleness must be an int >= 1, got {staleness!r} (for "
                             "synchronous averaging use allreduce_hook or a compressed hook)")
        # The state that sends the buckets, built first: this state's
        # statistics are its (HookState's constructor resets them).
        where: Dict[str, Any] = dict(communicator=communicator, path=path)
        if _compression.is_codec(wire):
            self.inner: HookState = CompressionState(process_group, wire, start_iter=0, **where)
            self._inner_hook: Callable = compression_hook
        elif wire in _WIRE_DTYPES:
            self.inner = AllReduceState(process_group, wire_dtype=wire, **where)
            self._inner_hook = allreduce_hook
        else:
            raise ValueError(f"pycomm.hooks.StaleState: wire={wire!r}; use None, torch.bfloat16, torch.float16, "
                             "pycomm.Int8(), pycomm.Int4() or pycomm.TopK(ratio)")
        super().__init__(process_group, communicator=communicator, path=path)
        self.staleness = staleness
        self.wire = wire
        # Steps started and not yet applied, oldest first: each a list of
        # the buckets' averages in flight.
        self._inflight: List[List[_InFlight]] = []
        self._started_step = -1  # the iteration whose list is _inflight[-1]
        #: Whether the step whose backward ran last handed DDP an average
        #: (False for the first ``staleness`` steps, and after :meth:`flush`).
        self.has_update = False

    @property
    def in_flight(self) -> int:
        """Steps whose averages are still to be applied (``staleness`` once warm)."""
        return len(self._inflight)

    def stats(self) -> Dict[str, float]:
        out = self.inner.stats()
        out["iterations"] = self.iteration
        out["staleness"] = self.staleness
        return out

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def routes(self) -> Dict[str, str]:
        return self.inner.routes()

    def state_dict(self) -> Dict[str, Any]:
        """The iteration count and the wire format's state (error-feedback
        residuals). Averages in flight are not part of it: call
        :meth:`flush` (and step) before saving, as at the end of training."""
        if self._inflight:
            raise RuntimeError(f"pycomm.hooks.StaleState: {len(self._inflight)} steps' averages are still in "
                               "flight; apply them with `for _ in state.flush(): opt.step()` before state_dict()")
        return {"iteration": self.iteration, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.inner.load_state_dict(state["inner"])
        self._inflight = []

    def flush(self) -> "Iterator[int]":
        """Waits for the averages still in flight and writes them, one step at
        a time and oldest first, into the parameters' ``.grad``; yields after
        each so that the caller steps its optimizer. Afterwards nothing is in
        flight, and the next ``staleness`` steps apply zeros again.

        Example::

            for _ in state.flush():
                opt.step()
        """
        while self._inflight:
            step = self._inflight.pop(0)
            for entry in step:
                avg = self._value(entry)
                for p, off in zip(entry.params, entry.offsets):
                    part = avg[off:off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = part.clone()
                    else:
                        p.grad.copy_(part)
            yield self.iteration - len(self._inflight) - 1
        self._started_step = -1

    # -------------------------------------------------------------- internals

    @staticmethod
    def _value(entry: _InFlight) -> torch.Tensor:
        value = entry.future.wait()
        value = value[0] if isinstance(value, list) else value
        if value.is_cuda:
            # Read a step-old average only once every stream of its device
            # is done: on one H100, 1 of 3 runs of the plain CUDA group path
            # (Gloo's CUDA all-reduce) read the buffer before the all-reduce
            # had written it, though its future had completed (with this
            # wait: 13 of 13 right). The average is a step old, so the wait
            # costs the device's queue, not the all-reduce.
            torch.cuda.synchronize(value.device)
        return value

    def _delayed(self, bucket: dist.GradBucket, buf: torch.Tensor) -> torch.futures.Future:
        """The average this bucket's parameters got ``staleness`` steps ago,
        as a future DDP waits on (normally complete already)."""
        old = self._inflight[0]
        ids = tuple(id(p) for p in bucket.parameters())
        same = next((e for e in old if e.ids == ids), None)
        if same is not None:
            return same.future.then(lambda fut: buf.copy_(self._value(same)))
        # DDP rebuilt its buckets since (after the first iteration): gather
        # each parameter's slice from wherever it travelled.
        where = {pid: (e, off) for e in old for pid, off in zip(e.ids, e.offsets)}
        off = 0
        for p in bucket.parameters():
            hit = where.get(id(p))
            if hit is None:  # not in that step's buckets (the model changed): nothing to apply
                buf[off:off + p.numel()].zero_()
            else:
                buf[off:off + p.numel()].copy_(self._value(hit[0])[hit[1]:hit[1] + p.numel()])
            off += p.numel()
        return completed(buf)


def stale_hook(state: StaleState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Start this bucket's average and hand DDP the one from ``staleness``
    steps ago (zeros during the first ``staleness`` steps); see
    :class:`StaleState` for the update rule.

    Example::

        ddp.register_comm_hook(hooks.StaleState(staleness=1, wire=torch.bfloat16), hooks.stale_hook)
    """
    if not isinstance(state, StaleState):
        raise TypeError(f"pycomm.hooks.stale_hook: state must be a pycomm.hooks.StaleState, got "
                        f"{type(state).__name__}")
    buf = bucket.buffer()
    with record_function("pycomm::stale_hook"):
        # 1. Start this step's average on a copy: DDP writes the average we
        #    return into `buf` (the gradients themselves with
        #    gradient_as_bucket_view) while this one still travels.
        snapshot = _Snapshot(bucket, buf.clone())
        future = state._inner_hook(state.inner, snapshot)
        if state._started_step != state.iteration:
            state._inflight.append([])
            state._started_step = state.iteration
        state._inflight[-1].append(_InFlight(snapshot.parameters(), future))
        # 2. Hand back the average of `staleness` steps ago, or zeros while
        #    there is none yet.
        if len(state._inflight) > state.staleness:
            result = state._delayed(bucket, buf)
        else:
            buf.zero_()
            result = completed(buf)
    if bucket.is_last():
        state.has_update = len(state._inflight) > state.staleness
        if state.has_update:
            state._inflight.pop(0)
        state.iteration += 1
    return result


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
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        if int(start_iter) < 0:
            raise ValueError(f"pycomm.hooks: start_iter must be >= 0, got {start_iter}")
        super().__init__(process_group, communicator=communicator, path=path)
        self.start_iter = int(start_iter)


def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages gradients during the warm-up, then returns each rank's own."""
    if not isinstance(state, LocalSGDState):
        raise TypeError(f"pycomm.hooks.local_sgd_hook: state must be a pycomm.hooks.LocalSGDState, got "
                        f"{type(state).__name__}")
    if state.iteration < state.start_iter:
        return _average(state, bucket, None, "pycomm::local_sgd_hook")
    fut = completed(bucket.buffer())
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

