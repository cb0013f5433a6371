"""The Python face of the communicator: collectives, compressed all-reduce and
point-to-point messages among the ranks of a ``torch.distributed`` group.

Point-to-point messages (``_point_to_point.py``) and registered memory
(``_registered.py``) are methods of :class:`Communicator` kept in files of their
own, as on the C++ side. How a communicator comes up (rendezvous through the
Store, hosts, shared memory, the process group between hosts) is in
:mod:`pycomm.bootstrap`. The file runs past 500 lines because every
collective's signature and docstring live here, in one place, where users
read them; the work each does is in the compiled core.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import weakref
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _debug, _env, bootstrap
from . import compression as _compression
from ._loader import CommError, Work, load_core
from ._point_to_point import PointToPoint
from ._registered import RegisteredMemory
from ._tables import ALGORITHMS, REDUCE_OPS, Op, collective_id, reduce_op_id

logger = logging.getLogger("pycomm")

# The collectives whose algorithm a caller (or PYCOMM_ALGO) may choose.
_TUNABLE = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


# Communicators made so far per Store object and group name: the index that
# names the next one. Keyed by the Store too, so that a job which destroys its
# default group and starts a new one (a new Store) counts from 0 again on every
# rank, whatever each process built before.
_instances: "weakref.WeakKeyDictionary[dist.Store, Dict[str, int]]" = weakref.WeakKeyDictionary()
_instances_lock = threading.Lock()


class Communicator(PointToPoint, RegisteredMemory):
    """Collectives among the ranks of a torch.distributed group.

    Every call returns ``None`` (``async_op=False``, the default: the result is
    in place when it returns) or a :class:`pycomm.Work` whose ``wait()`` and
    ``get_future()`` (a ``torch.futures.Future``) complete when the result is
    ready. Calls run in issue order, which must be the same on every rank.

    Example::

        dist.init_process_group("gloo")
        comm = pycomm.Communicator()
        t = torch.randn(1024)
        comm.all_reduce(t)                      # sum over ranks, in place
        work = comm.all_reduce(t, op="avg", async_op=True)
        work.wait()

    Args:
        group: the torch.distributed group whose ranks take part (default:
            the default group). Its Store is used for the bootstrap only.
        store, rank, world_size: bootstrap from an explicit Store instead.
        timeout: seconds any one collective may wait for a peer before every
            rank raises :class:`pycomm.CommError` (default 300, or
            ``PYCOMM_TIMEOUT``).
        round_bytes: shared-memory staging size per phase (default 1 MiB or
            ``PYCOMM_SHM_ROUND_BYTES``).
        name: the communicator's key space in the Store. By default the n-th
            communicator created on a group (since its Store was made) is
            named after the group and n; pass distinct names to build several on one explicit store.
        transport: ``"auto"`` (default, or ``PYCOMM_TRANSPORT``): shared memory
            inside a host, a process group between hosts; ``"pg"``: every
            transfer through the process group, even on one host;
            ``"shm"``: shared memory only (one host).
        local_size: treat consecutive blocks of this many ranks as hosts
            (default: detect hosts; or ``PYCOMM_LOCAL_SIZE``), for tests and
            for benchmarking a multi-host layout on one machine.
        inter_host_group: the process group that carries traffic between
            hosts (its rank r must be this communicator's rank r). Default: a
            private Gloo group on the bootstrap Store, so pycomm's traffic
            never interleaves with yours. Set ``GLOO_SOCKET_IFNAME`` to pick
            its network interface, as for any Gloo group. A communicator that
            aborted may leave transfers posted on the group (its last
            messages among them): give the one that replaces it a new group.
        bind_cores: bind every thread of this process to its local rank's
            share of the CPUs (``pycomm.bootstrap.bind_cores``; default off, or
            ``PYCOMM_BIND_CORES=1``), as DeepSpeed's ``--bind_cores_to_rank``:
            left to the scheduler, two ranks can share a core for a whole run
            and the large all-reduces of that run go 2-3x slower. Skipped
            (logged) when local ranks outnumber the CPUs.

    Several hosts::

        # torchrun --nnodes=2 --nproc-per-node=4 ... on each host
        dist.init_process_group("gloo")
        comm = pycomm.Communicator()      # comm.num_hosts == 2, comm.local_size == 4
        comm.all_reduce(t)                # hierarchical: shm, then between hosts, then shm
        comm.all_reduce(t, algorithm="ring")  # one flat ring over every rank
    """

    def __init__(
        self,
        group: Optional["dist.ProcessGroup"] = None,
        *,
        store: Optional["dist.Store"] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        timeout: Optional[Union[float, datetime.timedelta]] = None,
        round_bytes: Optional[int] = None,
        name: Optional[str] = None,
        transport: Optional[str] = None,
        local_size: Optional[int] = None,
        inter_host_group: Optional["dist.ProcessGroup"] = None,
        bind_cores: Optional[bool] = None,
        _host_label: Optional[str] = None,
        _stopped_after: Optional[float] = None,
        _known_peers: Optional[Dict[int, str]] = None,
    ) -> None:
        core = load_core()
        store, rank, world_size, group_name = bootstrap.resolve_group(group, store, rank, world_size)
        # What a shrink needs to build this communicator's successor.
        self._root: Optional["dist.Store"] = store
        if name is None:
            # Like torch's new_group: the n-th communicator of a group is the
            # n-th on every rank, provided ranks create them in the same order.
            with _instances_lock:
                counts = _instances.setdefault(store, {})
                index = counts.get(group_name, 0)
                counts[group_name] = index + 1
            name = f"{group_name}/{index}"
        self.name: str = name
        #: Membership epoch: 0 for a communicator made by the constructor, e + 1
        #: for one made by :func:`pycomm.elastic.shrink` or :func:`pycomm.elastic.admit` of a communicator of epoch e.
        self.epoch: int = 0
        #: The name a process passes to :func:`pycomm.elastic.join` to join this job: the
        #: epoch-0 communicator's name, kept by every shrink and admit.
        self.job: str = name
        #: Ranks of the communicator this one replaced (``parent_ranks[r]`` was
        #: rank r's rank there; -1 for a rank that joined); None at epoch 0.
        self.parent_ranks: Optional[List[int]] = None
        #: True on a process whose communicator came from :func:`pycomm.elastic.join`.
        self.joined: bool = False
        self._admitted_upto = 0  # joiners' tickets up to this one were admitted (pycomm.elastic)
        store = bootstrap.key_space(store, name)
        if timeout is None:
            timeout = _env.seconds("PYCOMM_TIMEOUT", bootstrap.DEFAULT_TIMEOUT_S)
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        timeout = _env.check_seconds(timeout, "timeout")
        transport = (transport or os.environ.get("PYCOMM_TRANSPORT", "auto")).strip().lower()
        self._settings = dict(round_bytes=round_bytes, transport=transport, bind_cores=bind_cores)
        self._c, topo, self._own_inter_host = bootstrap.connect(
            store, rank, world_size, timeout=float(timeout), round_bytes=round_bytes, transport=transport,
            local_size=local_size, inter_host_group=inter_host_group, host_label=_host_label,
            stopped_after=_stopped_after, known_peers=_known_peers)
        self.rank: int = rank
        self.world_size: int = world_size
        self.host: int = topo.host
        # The hosts a successor (shrink, admit) keeps.
        self._host_label: Optional[str] = topo.label
        self.local_rank: int = topo.local_rank
        self.local_size: int = topo.local_size
        self.num_hosts: int = topo.num_hosts
        if bind_cores is None:
            bind_cores = _env.flag("PYCOMM_BIND_CORES")
        #: The CPUs this process was bound to (``bind_cores``), or None.
        self.cpus: Optional[List[int]] = (
            bootstrap.bind_cores(topo.local_rank, topo.local_size) if bind_cores else None)
        self._stats = {"compressed_calls": 0, "bytes_sent": 0, "bytes_uncompressed": 0}

        # PYCOMM_ALGO is a preference: collectives it cannot run fall back to
        # the tuner, and say so once.
        self._auto = (ALGORITHMS["auto"], False)
        self._default_algo: Dict[str, Tuple[int, bool]] = {}
        env_algo = os.environ.get("PYCOMM_ALGO", "").strip().lower()
        if env_algo and env_algo != "auto":
            if env_algo not in ALGORITHMS:
                raise CommError(f"pycomm: PYCOMM_ALGO={env_algo!r} is not one of {', '.join(ALGORITHMS)}")
            for coll in _TUNABLE:
                if core.algorithm_applies(ALGORITHMS[env_algo], collective_id(coll)):
                    self._default_algo[coll] = (ALGORITHMS[env_algo], False)
                elif rank == 0:
                    logger.info("pycomm: PYCOMM_ALGO=%s does not apply to %s; using the tuner's choice",
                                env_algo, coll)
        _debug.log_communicator(self, _TUNABLE)

    def _algorithm(self, algorithm: str, coll: str) -> Tuple[int, bool]:
        if algorithm == "auto":
            return self._default_algo.get(coll) or self._auto
        algo = ALGORITHMS.get(algorithm)
        if algo is None:
            self._c.reject(f"pycomm.{coll}: unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        return algo, True

    def _op(self, op: Op, coll: str) -> int:
        op_id = reduce_op_id(op)
        if op_id is None:
            self._c.reject(f"pycomm.{coll}: unsupported reduce op {op!r}; "
                           f"use one of {', '.join(REDUCE_OPS)} or the matching dist.ReduceOp")
        return op_id

    # -------------------------------------------------------------- collectives

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Op = "sum",
        *,
        output: Optional[torch.Tensor] = None,
        algorithm: str = "auto",
        async_op: bool = False,
        compression: Optional["_compression.Codec"] = None,
        error_feedback: Optional["_compression.ErrorFeedback"] = None,
        key: Optional[Hashable] = None,
    ) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks; the result lands in ``output`` (default: in place).

        ``op`` is ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``, ``"band"``, ``"bor"``,
        ``"bxor"`` or the matching ``dist.ReduceOp`` (bitwise ops on integral and bool tensors only).
        float16/bfloat16 accumulate in float32. Every rank gets the same bits.

        ``compression`` (:class:`pycomm.Int8`, :class:`pycomm.Int4`,
        :class:`pycomm.TopK`) sends compressed data instead (sum or avg of
        float tensors; accuracy in :mod:`pycomm.compression`). With
        ``error_feedback`` (a :class:`pycomm.compression.ErrorFeedback`), what
        compression dropped is carried to the next call with the same ``key``
        (default: the tensor's storage address). The returned Work's
        ``bytes_sent`` / ``bytes_uncompressed`` and :attr:`stats` tell what it saved.

        Example::

            comm.all_reduce(grad, op="avg")
            out = torch.empty_like(x); comm.all_reduce(x, output=out, algorithm="ring")
            comm.all_reduce(grad, op="avg", compression=pycomm.Int8(), error_feedback=ef, key="bucket0")
        """
        if compression is not None:
            return self._all_reduce_compressed(tensor, op, output, algorithm, async_op, compression,
                                               error_feedback, key)
        if error_feedback is not None:
            self._c.reject("pycomm.all_reduce: error_feedback needs compression= as well")
        algo, strict = self._algorithm(algorithm, "all_reduce")
        op_id = self._op(op, "all_reduce")
        work = self._c.all_reduce(tensor, tensor if output is None else output, op_id, algo, strict, async_op)
        return work if async_op else None

    def _all_reduce_compressed(self, tensor, op, output, algorithm, async_op, codec, error_feedback, key):
        op_id = self._op(op, "all_reduce")
        if algorithm not in ("auto", "direct"):
            self._c.reject(f"pycomm.all_reduce: compression runs its own algorithm; algorithm={algorithm!r} "
                           "cannot be combined with it (use 'auto')")
        if not _compression.is_codec(codec):
            self._c.reject(f"pycomm.all_reduce: compression={codec!r} is not a codec; use pycomm.Int8(), "
                           "pycomm.Int4() or pycomm.TopK()")
        worker = server = None
        if error_feedback is not None:
            if key is None:
                key = tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None
            worker, server = error_feedback.residuals(key, tensor, codec,
                                                      self.compressed_shard_numel(tensor.numel(), codec))
        work = self._c.all_reduce_compressed(tensor, tensor if output is None else output, op_id,
                                             *_compression.core_args(codec), worker, server, async_op)
        self._stats["compressed_calls"] += 1
        self._stats["bytes_sent"] += work.bytes_sent
        self._stats["bytes_uncompressed"] += work.bytes_uncompressed
        return work if async_op else None

    def compressed_shard_numel(self, numel: int, codec: "_compression.Codec") -> int:
        """Elements of this rank's reduced shard when a tensor of ``numel`` elements is
        all-reduced with ``codec``: the size of its server error-feedback residual
        (0 for codecs without one).

        Example::

            comm.compressed_shard_numel(grad.numel(), pycomm.Int8())
        """
        if not _compression.is_quantizer(codec):
            return 0
        return self._c.compressed_shard_elems(int(numel), int(codec.block))

    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: Op = "sum",
        *,
        compression: Optional["_compression.Codec"] = None,
    ) -> None:
        """Reduce many tensors in place with one flat all-reduce per dtype.

        A few large messages instead of one per tensor (torch's
        ``all_reduce_coalesced``): the tensors of each dtype are packed into one
        buffer, reduced, and copied back. ``compression`` applies to the dtypes
        it takes (float32, float16, bfloat16); other dtypes go uncompressed.
        Every rank must pass the same dtypes and sizes in the same order.

        Example::

            comm.all_reduce_coalesced([p.grad for p in model.parameters()], op="avg")
        """
        compressible = _compression.codec_dtypes()
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                codec = compression if dtype in compressible else None
                numel = sum(t.numel() for t in group)
                if codec is None and all(t.device.type == "cpu" for t in group):
                    # Registered scratch where it pays (the extension decides;
                    # ordinary memory otherwise): the all-reduce runs in place.
                    nbytes = numel * group[0].element_size()
                    flat = self._c.caller_scratch(nbytes)[:nbytes].view(dtype)
                    torch.cat([t.detach().reshape(-1) for t in group], out=flat)
                else:
                    flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.all_reduce(flat, op, compression=codec)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    @property
    def stats(self) -> Dict[str, int]:
        """Totals over this communicator's compressed all-reduces: calls, bytes sent, bytes uncompressed.

        Bytes are what this rank hands to its peers; "uncompressed" is what the
        plain all-reduce would hand them (2(n-1)/n x the tensor).
        """
        return dict(self._stats)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: Union[torch.Tensor, Sequence[torch.Tensor]],
        op: Op = "sum",
        *,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Optional[Work]:
        """Reduce ``input`` (world_size x output.numel() elements) over ranks; rank r keeps shard r.

        ``input`` may also be a list of world_size tensors shaped like ``output``.
        In place as with NCCL: ``output`` may be this rank's block of ``input``.

        Example::

            out = torch.empty(n); comm.reduce_scatter(out, torch.randn(world * n))
            x = torch.randn(world * n); comm.reduce_scatter(x[rank * n:(rank + 1) * n], x)  # in place
        """
        if not isinstance(input, torch.Tensor):
            input = torch.cat([t.reshape(-1) for t in input])
        algo, strict = self._algorithm(algorithm, "reduce_scatter")
        op_id = self._op(op, "reduce_scatter")
        work = self._c.reduce_scatter(output, input, op_id, algo, strict, async_op)
        return work if async_op else None

    def all_gather(
        self,
        output: Union[torch.Tensor, List[torch.Tensor]],
        input: torch.Tensor,
        *,
        algorithm: str = "auto",
        async_op: bool = False,
    ) -> Optional[Work]:
        """Gather every rank's ``input`` into ``output`` (world_size x input.numel(), rank order).

        ``output`` may also be a list of world_size tensors shaped like ``input``
        (synchronous calls only).

        Example::

            out = torch.empty(world * n); comm.all_gather(out, x)
        """
        algo, strict = self._algorithm(algorithm, "all_gather")
        if isinstance(output, torch.Tensor):
            work = self._c.all_gather(output, input, algo, strict, async_op)
            return work if async_op else None
        if async_op:
            self._c.reject("pycomm.all_gather: pass one flat output tensor for async_op=True")
        if len(output) != self.world_size:
            self._c.reject(f"pycomm.all_gather: output list has {len(output)} tensors, expected {self.world_size}")
        flat = torch.empty(self.world_size * input.numel(), dtype=input.dtype, device=input.device)
        self._c.all_gather(flat, input, algo, strict, False)
        for r, t in enumerate(output):
            t.copy_(flat[r * input.numel():(r + 1) * input.numel()].view_as(t))
        return None

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, algorithm: str = "auto", async_op: bool = False
    ) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank.

        Example::

            comm.broadcast(params, src=0)
        """
        algo, strict = self._algorithm(algorithm, "broadcast")
        work = self._c.broadcast(tensor, int(src), algo, strict, async_op)
        return work if async_op else None

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Optional[Work]:
        """Rank r sends block p of ``input`` to rank p, which stores it as block r of ``output``.

        Both tensors have world_size equal blocks (torch's ``all_to_all_single``
        without split sizes).

        Example::

            out = torch.empty(world * n); comm.all_to_all_single(out, torch.randn(world * n))
        """
        work = self._c.all_to_all(output, input, async_op)
        return work if async_op else None

    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Return once every rank has called barrier (or a Work that completes then)."""
        work = self._c.barrier(async_op)
        return work if async_op else None

    # ------------------------------------------------------------------- misc

    def resolve_algorithm(self, collective: str, algorithm: str, nbytes: int) -> str:
        """The concrete algorithm a call of ``nbytes`` per rank would run (e.g. what "auto" picks)."""
        algo, _ = self._algorithm(algorithm, collective)
        return self._c.resolve(collective_id(collective), algo, int(nbytes))

    @property
    def timeout(self) -> float:
        """Seconds one collective may wait for a peer before raising CommError."""
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._c.timeout = _env.check_seconds(seconds, "timeout")

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds without a heartbeat after which a peer is declared failed.

        Every rank beats from a thread of its own (in shared memory every
        0.1 s for the peers of its host; on the Store, a fifth of this bound
        but at most every 0.5 s, for the peers of other hosts), so a peer
        that computes for long is never declared failed, while one that is
        stopped (SIGSTOP) or frozen, or whose machine stalled, is, within
        this bound instead of the collective timeout: the waiting ranks raise
        CommError naming it (``failure == "silent"``), and :func:`pycomm.elastic.shrink`
        leaves it out. A frozen rank that wakes up reads that it was declared
        and raises (it is out; its shrink says it was fenced out). Default
        5 s (``PYCOMM_HEARTBEAT_S``); 0 stops judging peers. With
        ``PYCOMM_HEARTBEAT_S=0`` at start a rank neither beats nor judges
        (and is never judged). A shrunk or grown communicator keeps the bound.

        Example::

            comm.heartbeat_timeout = 2.0   # a frozen peer fails the survivors' call within ~2 s
        """
        return self._c.heartbeat_timeout

    @heartbeat_timeout.setter
    def heartbeat_timeout(self, seconds: float) -> None:
        self._c.heartbeat_timeout = _env.check_seconds(seconds, "heartbeat_timeout", zero_ok=True)

    def abort(self, reason: str = "aborted by the user", *, name_rank: bool = True) -> None:
        """Make the current and every later collective fail on every rank: at
        once on this host, within a heartbeat period on the others (through
        the Store; at their timeout with ``PYCOMM_HEARTBEAT_S=0``).

        The error reads ``"pycomm: rank <r>: <reason>"``; with
        ``name_rank=False`` it is ``reason`` as given (for a reason that already
        names its origin, such as a peer's error passed on).

        Example::

            comm.abort("stage 2 raised ValueError")
        """
        self._c.abort(f"pycomm: rank {self.rank}: {reason}" if name_rank else reason)

    def close(self) -> None:
        """Finish queued collectives and leave; later calls raise CommError.

        A closed communicator of one host holds no store: the job's store
        (a TCPStore's server, and the keys this communicator left there) goes
        with torch.distributed's group, so that an ``init_process_group`` on
        the same port after ``destroy_process_group`` starts from an empty
        store, even while the closed communicator is still referenced.
        """
        self._c.shutdown()
        self._root = None

    @property
    def _root_store(self) -> "dist.Store":
        """The store this communicator was built from (unprefixed), for
        :mod:`pycomm.elastic` to build successors from."""
        if self._root is None:
            raise CommError("pycomm: this communicator was closed; it no longer holds the job's store")
        return self._root

    def gone_ranks(self) -> List[int]:
        """Ranks known to be gone for good: dead or frozen on this host, or blamed as dead by a failure."""
        return list(self._c.gone_ranks())

    @property
    def failure(self) -> Optional[str]:
        """Why this communicator failed (what its next call would raise), or
        None while it has not, as far as this rank can tell without a call:
        an abort seen in this host's shared memory, a peer found silent.

        Example::

            if comm.failure is not None: ...   # e.g. "pycomm: rank 2 died (...)"
        """
        return self._c.failure() or None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transport(self) -> str:
        """What carries the data: "shm", "process_group" or "shm+process_group"."""
        return self._c.transport

    @property
    def round_bytes(self) -> int:
        """Shared-memory staging bytes per round and phase (0 without shared memory)."""
        return self._c.round_bytes

    def as_c10d_backend(self, peer: Optional[object] = None) -> object:
        """This communicator as a ``torch.distributed`` Backend object (``c10d::Backend``).

        What the ``"pycomm"`` backend hands torch for a group (see
        :mod:`pycomm.c10d`). ``peer``, a backend over the same ranks (a Gloo
        group), carries send/recv and uneven all-to-all; without it those raise.
        The backend prefers this communicator's ``PYCOMM_ALGO`` algorithms.
        """
        algorithms = [self._algorithm("auto", c)[0] for c in _TUNABLE]
        return load_core().make_backend(self._c, peer, algorithms)

    def __repr__(self) -> str:
        return (f"pycomm.Communicator(rank={self.rank}, world_size={self.world_size}, hosts={self.num_hosts}, "
                f"local_size={self.local_size}, transport={self.transport!r})")
