"""Which path a bucket takes: the hooks' policy, decided once per kind of
bucket and logged (INFO, logger ``pycomm``) with its reason.

* CPU buckets: pycomm's :class:`~pycomm.Communicator` (shared memory within a
  host, its inter-host transport between hosts).
* CUDA buckets, compressed with Int8/Int4: CUDA IPC's quantized all-reduce
  (the codes travel through the peers' buffers) when every rank is on one
  host, each on its own GPU, and the bucket's codes fit the IPC buffer;
  otherwise (and for top-k) :class:`~pycomm.GroupCommunicator`, pycomm's CUDA
  kernels composed with the group's own collectives (NCCL), on the device.
  Both give the communicator's bits.
* CUDA buckets, plain: CUDA IPC when every rank is on one host, each on its
  own GPU; otherwise the group's own all-reduce.
* Buckets of sparse gradients (``nn.Embedding(sparse=True)``; DDP gives each
  such parameter a bucket of its own), under every hook: averaged as they
  are, never compressed, as DDP averages them without a hook: on the CPU
  through the communicator (every rank's indices and values gathered, then
  summed by coalescing, as Gloo's sparse all-reduce does), else through the
  group's own all-reduce.

``path=`` on a state (or ``PYCOMM_HOOK_PATH``) forces one of :data:`PATHS`.

Example::

    state = hooks.AllReduceState(path="group")   # CPU buckets then go over Gloo
    ddp.register_comm_hook(state, hooks.allreduce_hook)
    state.routes()                               # {"cpu/plain": "group"} after the first bucket
"""
import logging
import os
import socket
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import communicator as _communicator
from .. import default as _default
from .. import group as _group
from .._lanes import device_backend
from .._loader import CommError, load_core
from .futures import Done, GroupFutures

logger = logging.getLogger("pycomm")

Group = Union[None, dist.ProcessGroup, _communicator.Communicator]
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


def sparse_average(comm: "_communicator.Communicator", t: torch.Tensor) -> torch.Tensor:
    """The average over ``comm``'s ranks of the sparse COO tensor ``t``: every
    rank's entries gathered in rank order and summed by coalescing (Gloo's
    sparse all-reduce), then divided by the ranks. The entry counts differ
    between ranks, so the sizes travel first and the entries padded to the
    largest. Every rank computes the same bits."""
    t = t.coalesce()
    world, nnz = comm.world_size, t._nnz()
    sizes = torch.empty(world, dtype=torch.int64)
    comm.all_gather(sizes, torch.tensor([nnz], dtype=torch.int64))
    most = int(sizes.max())
    if most == 0:
        return t / world
    idx = torch.zeros(t.sparse_dim(), most, dtype=torch.int64)
    idx[:, :nnz] = t._indices()
    val = torch.zeros((most,) + tuple(t._values().shape[1:]), dtype=t.dtype)
    val[:nnz] = t._values()
    all_idx = torch.empty((world,) + tuple(idx.shape), dtype=torch.int64)
    all_val = torch.empty((world,) + tuple(val.shape), dtype=t.dtype)
    comm.all_gather(all_idx, idx)
    comm.all_gather(all_val, val)
    indices = torch.cat([all_idx[r, :, :int(sizes[r])] for r in range(world)], dim=1)
    values = torch.cat([all_val[r, :int(sizes[r])] for r in range(world)])
    # Checked: the indices came from other processes.
    return torch.sparse_coo_tensor(indices, values, t.shape, check_invariants=True).coalesce() / world


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


class Router:
    """Where a hook state's buckets go: the communicator (CPU), the group path
    or CUDA IPC (CUDA), set up at the first bucket that needs each,
    collectively. :class:`~pycomm.hooks.HookState` is one.

    Args:
        process_group: the ranks DDP averages over (or a Communicator).
        communicator: an existing communicator to share.
        path: ``"auto"``, ``"group"``, ``"ipc"`` or ``"communicator"``;
            default: ``PYCOMM_HOOK_PATH`` or ``"auto"``.
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
        self._futures: Optional[GroupFutures] = None
        self._said_too_big = False

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

    def routes(self) -> Dict[str, str]:
        """The path each kind of bucket took so far, e.g. ``{"cuda/compressed": "group"}``
        (``"cpu/sparse"`` for buckets of sparse gradients)."""
        return {f"{dev}/{c if isinstance(c, str) else 'compressed' if c else 'plain'}": r
                for (dev, c), r in self._routes.items()}

    def _sparse_future(self, bucket: dist.GradBucket) -> Optional[torch.futures.Future]:
        """The average of a bucket of sparse gradients, or None for a dense
        bucket (the module docstring says how; decided once, logged). pycomm's
        codecs and kernels take dense tensors: every hook averages such a
        bucket as DDP does without a hook, uncompressed, in the same step."""
        buf = bucket.buffer()
        if buf.layout == torch.strided:
            return None
        if buf.layout != torch.sparse_coo:
            raise CommError(f"pycomm.hooks: gradients of layout {buf.layout} are not supported (dense and sparse "
                            "COO are)")
        key = (buf.device.type, "sparse")
        route = self._routes.get(key)
        if route is None:
            on_comm = buf.device.type == "cpu" and self.path in ("auto", "communicator")
            route = self._routes[key] = "communicator" if on_comm else "group"
            logger.info("pycomm.hooks: %s buckets of sparse gradients take the %s path, uncompressed: pycomm's "
                        "codecs and kernels take dense tensors", buf.device.type, route)
        if route == "communicator":
            return completed(sparse_average(self.communicator, buf))
        if self._comm_arg is not None:
            raise CommError("pycomm.hooks: sparse CUDA gradients go through the group's own all-reduce; build the "
                            "state with the DDP process group (or none), not a communicator")
        work = self._start_all_reduce("group", buf, "avg")
        return self._group_future(work, lambda fut: fut.value()[0], buf.device)


    def _route(self, buf: torch.Tensor, compressed: bool, quantized: bool = False) -> str:
        """The path of a bucket like ``buf``: decided once per device type and
        kind (collectively where it asks the peers), logged with its reason.
        ``quantized``: a compressed bucket that is one Int8/Int4 all-reduce
        (the compressed hooks), which CUDA IPC can carry; other compression
        (top-k, PowerSGD's factors, DiLoCo) takes the group path."""
        key = (buf.device.type, compressed)
        route = self._routes.get(key)
        if route is None:
            route, why = self._decide(buf, compressed, quantized)
            self._routes[key] = route
            logger.info("pycomm.hooks: %s %s buckets take the %s path: %s", buf.device.type,
                        "compressed" if compressed else "plain", route, why)
        return route

    def _decide(self, buf: torch.Tensor, compressed: bool, quantized: bool = False) -> Tuple[str, str]:
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
        backend = device_backend(self.process_group, buf.device)
        if compressed and not quantized:
            return "group", (forced if self.path == "group" else "compressed CUDA buckets are composed from "
                             f"pycomm's CUDA kernels and the group's own collectives ({backend}), on the device")
        if self.path in ("group", "ipc"):
            return self.path, forced
        why_not = self._ipc_refusal(buf.device)
        if why_not is None:
            return "ipc", ("every rank is on this host, each on its own GPU: CUDA IPC's quantized all-reduce (codes "
                           "through the peers' buffers)" if compressed else
                           "every rank is on this host, each on its own GPU: CUDA IPC (one kernel per call)")
        if compressed:
            return "group", (f"pycomm's CUDA kernels and the group's own collectives ({backend}), on the device: "
                             f"{why_not}")
        return "group", f"the group's own all-reduce ({backend}): {why_not}"

    def _compressed_path(self, route: str, buf: torch.Tensor, codec: Any) -> Any:
        """What carries a compressed bucket on ``route``: the communicator, the
        group path, or the IPC group (the group path for a bucket whose codes
        do not fit the IPC buffer; said once)."""
        if route == "communicator":
            return self.communicator
        if route == "ipc":
            ipc = self._ipc_group(buf.device)
            if ipc.fits(buf.numel(), codec):
                return ipc
            if not self._said_too_big:
                self._said_too_big = True
                logger.info("pycomm.hooks: a compressed bucket of %d elements does not fit the CUDA IPC buffer "
                            "(%d bytes): such buckets take the group path", buf.numel(), ipc.buffer_bytes)
        return self._group_communicator()

    def _ipc_refusal(self, device: torch.device) -> Optional[str]:
        """Why CUDA IPC cannot carry this group's plain buckets, or None if it
        can; the same answer on every rank (it asks them all)."""
        props = torch.cuda.get_device_properties(device)
        gpu = str(props.uuid) if hasattr(props, "uuid") else f"{socket.gethostname()}/{device}"
        mine = (socket.gethostname(), gpu, bool(getattr(load_core(), "has_cuda", False)))
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        return ipc_refusal(everyone)

    def _start_all_reduce(self, route: str, tensor: torch.Tensor, op: str, codec: Any = None,
                          error_feedback: Any = None, key: Any = None) -> Any:
        """Starts ``tensor``'s all-reduce on ``route`` ("communicator" or
        "group"), compressed with ``codec`` (and its error feedback under
        ``key``) when given; returns the work. The group's own all-reduce has
        no average (Gloo): ``"avg"`` divides first, as torch's hooks do."""
        if route == "communicator":
            return self.communicator.all_reduce(tensor, op=op, compression=codec, error_feedback=error_feedback,
                                                key=key, async_op=True)
        if codec is not None:
            return self._group_communicator().all_reduce(tensor, op=op, compression=codec,
                                                         error_feedback=error_feedback, key=key, async_op=True)
        if op == "avg":
            tensor.div_(self.world_size)
        return dist.all_reduce(tensor, group=self.process_group, async_op=True)

    def _group_future(self, work: Any, done: Done, device: torch.device) -> torch.futures.Future:
        """The hook's future of ``done`` over a work of the process group's
        own: NCCL's through ``then`` (it completes on the caller's thread),
        any other backend's from a thread of pycomm's (:mod:`.futures` says
        which deadlock that avoids)."""
        if device_backend(self.process_group, device) == "nccl":
            return work.get_future().then(done)
        if self._futures is None:
            self._futures = GroupFutures()
        return self._futures.complete(work, done, device)

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
            from .. import cuda_ipc

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
