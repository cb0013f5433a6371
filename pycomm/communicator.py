"""The Python face of the communicator, and its bootstrap from torch.distributed.

pycomm has no rendezvous of its own: ranks meet through a ``torch.distributed``
Store (the default group's, or one you pass), agree on a random per-job token,
find which ranks share a host, and map one shared-memory segment per host.
Between hosts the data travels through a ``torch.distributed`` process group
(a private Gloo group built on the same Store, or one you pass).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import secrets
import socket
import threading
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import compression as _compression
from ._loader import CommError, Work, load_core

logger = logging.getLogger("pycomm")

# Ids shared with csrc/ (enum values there).
ALGORITHMS: Dict[str, int] = {"auto": 0, "ring": 1, "tree": 2, "direct": 3, "hierarchical": 6, "hier": 6}
TRANSPORTS = ("auto", "shm", "pg")
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, BARRIER, _INVALID, ALL_TO_ALL = range(7)
COLLECTIVE_NAMES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "invalid", "all_to_all"]
_OPS: Dict[object, int] = {"sum": 0, "avg": 1, "max": 2, "min": 3}
for _name, _id in (("SUM", 0), ("AVG", 1), ("MAX", 2), ("MIN", 3)):
    if hasattr(dist, "ReduceOp") and hasattr(dist.ReduceOp, _name):
        _OPS[getattr(dist.ReduceOp, _name)] = _id

DEFAULT_TIMEOUT_S = 300.0
# One phase region of a rank's mailbox half; a rank maps 4 of them per peer.
# 1 MiB keeps a round's chunks in the last-level cache between the writer and
# its readers; see benchmarks/RESULTS.md for the sweep that chose it.
DEFAULT_ROUND_BYTES = 1 << 20
# Between hosts: one round's chunks together, and how many rounds are in
# flight (benchmarks/RESULTS.md, "Several hosts").
DEFAULT_PG_ROUND_BYTES = 4 << 20
DEFAULT_PG_WINDOW = 4
# Each ordered pair of ranks that exchange point-to-point messages maps one
# ring of this size (a power of two): enough for a sender to stream while its
# receiver copies out, small next to a pipeline's activations.
DEFAULT_P2P_BYTES = 4 << 20

Op = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


def _check_tag(tag: int) -> int:
    if type(tag) is not int or not 0 <= tag < 2 ** 32:
        raise CommError(f"pycomm: tag must be an int in [0, 2**32), got {tag!r}")
    return tag


def _op_id(op: Op) -> Optional[int]:
    # A bare int would match torch's RedOpType of the same value (3 is MIN):
    # a silent reinterpretation, so it is refused like any unknown op.
    if type(op) in (int, bool):
        return None
    try:
        return _OPS[op if not isinstance(op, str) else op.lower()]
    except (KeyError, TypeError):
        return None


def _host_key() -> str:
    """Ranks with equal keys share memory: same kernel boot and network namespace.

    The namespace matters for the simulated multi-host testbed, where ranks in
    separate network namespaces of one machine must count as separate hosts.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}|{boot}|{netns}"


def _parse_round_bytes(value: Optional[int]) -> int:
    if value is None:
        value = _env_size("PYCOMM_SHM_ROUND_BYTES", DEFAULT_ROUND_BYTES)
    return max(64 * 1024, int(value) // 4096 * 4096)


def parse_size(text: str) -> int:
    """Bytes from '4096', '64K', '1M', '2G' or '64MB'; ValueError if it is none of those."""
    t = text.strip().upper().rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


_instances_per_group: Dict[str, int] = {}
_instances_lock = threading.Lock()


class Communicator:
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
            communicator created on a group is named after the group and n;
            pass distinct names to build several on one explicit store.
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
            its network interface, as for any Gloo group.

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
    ) -> None:
        core = load_core()
        store, rank, world_size, group_name = _resolve_bootstrap(group, store, rank, world_size)
        if name is None:
            # Like torch's new_group: the n-th communicator of a group is the
            # n-th on every rank, provided ranks create them in the same order.
            with _instances_lock:
                index = _instances_per_group.get(group_name, 0)
                _instances_per_group[group_name] = index + 1
            name = f"{group_name}/{index}"
        store = dist.PrefixStore(f"pycomm/{name}/{restart_prefix()}", store)
        if timeout is None:
            timeout = float(os.environ.get("PYCOMM_TIMEOUT", DEFAULT_TIMEOUT_S))
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self.rank: int = rank
        self.world_size: int = world_size
        self._stats = {"compressed_calls": 0, "bytes_sent": 0, "bytes_uncompressed": 0}

        transport = (transport or os.environ.get("PYCOMM_TRANSPORT", "auto")).strip().lower()
        if transport not in TRANSPORTS:
            raise CommError(f"pycomm: transport={transport!r} is not one of {', '.join(TRANSPORTS)}")

        # 1. Topology: which ranks share a host. Hosts are numbered by their
        #    lowest rank, local ranks by rank.
        hosts = self._exchange_hosts(store, rank, world_size, float(timeout), local_size)
        host_keys = sorted(set(hosts), key=hosts.index)
        host_ranks = [[r for r in range(world_size) if hosts[r] == k] for k in host_keys]
        self.host: int = host_keys.index(hosts[rank])
        local_ranks = host_ranks[self.host]
        self.local_rank: int = local_ranks.index(rank)
        self.local_size: int = len(local_ranks)
        self.num_hosts: int = len(host_keys)
        if transport == "shm" and self.num_hosts > 1:
            raise CommError(f"pycomm: transport='shm' cannot connect the {self.num_hosts} hosts of this job; "
                            "use 'auto'")
        use_shm = transport != "pg"
        use_pg = transport == "pg" or self.num_hosts > 1

        # 2. One random token per job: segment names nobody can guess, and a
        #    check that we attach to this job's segment and no other.
        if rank == 0:
            store.set("token", secrets.token_hex(16))
        _wait_keys(store, ["token"], float(timeout), "rank 0 to publish the job token")
        token = store.get("token").decode()
        shm_name = f"/pycomm.{token}.{min(local_ranks)}"
        key = f"segment/{min(local_ranks)}"
        round_bytes = _parse_round_bytes(round_bytes)

        # 3. Between hosts: a process group (built before the segment, so a
        #    rank that fails here leaves no segment behind).
        backend = None
        if use_pg:
            backend = _inter_host_backend(inter_host_group, store, rank, world_size, float(timeout))
        args = dict(rank=rank, world=world_size, timeout=float(timeout), use_shm=use_shm,
                    local_rank=self.local_rank, local_size=self.local_size, shm_name=shm_name, token=token,
                    round_bytes=round_bytes, host=self.host, host_ranks=host_ranks if use_pg else [],
                    backend=backend, pg_round_bytes=_env_size("PYCOMM_PG_ROUND_BYTES", DEFAULT_PG_ROUND_BYTES),
                    pg_window=int(os.environ.get("PYCOMM_PG_WINDOW", DEFAULT_PG_WINDOW)),
                    store=store if use_pg else None,
                    p2p_bytes=_env_size("PYCOMM_P2P_BYTES", DEFAULT_P2P_BYTES))

        # 4. The host's first rank creates the segment, the others attach.
        if not use_shm:
            self._c = core.Communicator(**args)
        elif self.local_rank == 0:
            try:
                self._c = core.Communicator(create=True, **args)
            except Exception as e:
                store.set(key, f"error: {e}")
                raise
            store.set(key, "ok")
        else:
            _wait_keys(store, [key], float(timeout), f"rank {min(local_ranks)} to create the shared segment")
            status = store.get(key).decode()
            if status != "ok":
                raise CommError(f"pycomm: rank {min(local_ranks)} could not create the shared segment: {status}")
            self._c = core.Communicator(create=False, **args)
        # Return only once every local rank has mapped the segment (which is
        # then unlinked): a fast rank must not leave before a slow one joined.
        self._c.wait_ready()

        # 5. PYCOMM_ALGO is a preference: collectives it cannot run fall back
        #    to the tuner, and say so once.
        self._default_algo: List[Tuple[int, bool]] = [(0, False)] * 5
        env_algo = os.environ.get("PYCOMM_ALGO", "").strip().lower()
        if env_algo and env_algo != "auto":
            if env_algo not in ALGORITHMS:
                raise CommError(f"pycomm: PYCOMM_ALGO={env_algo!r} is not one of {', '.join(ALGORITHMS)}")
            for coll in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST):
                algo_id = ALGORITHMS[env_algo]
                if env_algo in ("direct", "hierarchical", "hier") or core.algorithm_supports(algo_id, coll):
                    self._default_algo[coll] = (algo_id, False)
                elif rank == 0:
                    logger.info("pycomm: PYCOMM_ALGO=%s does not apply to %s; using the tuner's choice",
                                env_algo, COLLECTIVE_NAMES[coll])

    @staticmethod
    def _exchange_hosts(store: "dist.Store", rank: int, world_size: int, timeout: float,
                        local_size: Optional[int]) -> List[str]:
        store.set(f"host/{rank}", _host_key())
        keys = [f"host/{r}" for r in range(world_size)]
        _wait_keys(store, keys, timeout, "every rank to join")
        values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        hosts = [v.decode() for v in values]
        if local_size is None and os.environ.get("PYCOMM_LOCAL_SIZE"):
            local_size = int(os.environ["PYCOMM_LOCAL_SIZE"])
        if local_size is not None:
            # Tests and benchmarks: pretend consecutive blocks of ranks are hosts.
            n = int(local_size)
            if n <= 0 or world_size % n:
                raise CommError(f"pycomm: local_size={n} must divide the world size {world_size}")
            hosts = [f"{h}#block{r // n}" for r, h in enumerate(hosts)]
        return hosts

    def _algorithm(self, algorithm: str, coll: int) -> Tuple[int, bool]:
        if algorithm == "auto":
            return self._default_algo[coll]
        algo = ALGORITHMS.get(algorithm)
        if algo is None:
            self._c.reject(f"pycomm.{COLLECTIVE_NAMES[coll]}: unknown algorithm {algorithm!r}; "
                           f"use one of {', '.join(ALGORITHMS)}")
        return algo, True

    def _op(self, op: Op, coll: int) -> int:
        op_id = _op_id(op)
        if op_id is None:
            self._c.reject(f"pycomm.{COLLECTIVE_NAMES[coll]}: unsupported reduce op {op!r}; "
                           "use sum, avg, max, min or the matching dist.ReduceOp")
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

        ``op`` is ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or a ``dist.ReduceOp``.
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
        algo, strict = self._algorithm(algorithm, ALL_REDUCE)
        op_id = self._op(op, ALL_REDUCE)
        work = self._c.all_reduce(tensor, tensor if output is None else output, op_id, algo, strict, async_op)
        return work if async_op else None

    def _all_reduce_compressed(self, tensor, op, output, algorithm, async_op, codec, error_feedback, key):
        op_id = self._op(op, ALL_REDUCE)
        if algorithm not in ("auto", "direct"):
            self._c.reject(f"pycomm.all_reduce: compression runs its own algorithm; algorithm={algorithm!r} "
                           "cannot be combined with it (use 'auto')")
        if not isinstance(codec, (_compression.Int8, _compression.Int4, _compression.TopK)):
            self._c.reject(f"pycomm.all_reduce: compression={codec!r} is not a codec; use pycomm.Int8(), "
                           "pycomm.Int4() or pycomm.TopK()")
        quant = _compression.is_quantizer(codec)
        worker = server = None
        if error_feedback is not None:
            if key is None:
                key = tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None
            shard = self._c.compressed_shard_elems(tensor.numel(), codec.block) if quant else 0
            worker, server = error_feedback.residuals(key, tensor, codec, shard)
        # Fields a codec does not have keep the C++ Codec's defaults.
        work = self._c.all_reduce_compressed(
            tensor, tensor if output is None else output, op_id, codec.kind, int(getattr(codec, "block", 256)),
            bool(getattr(codec, "stochastic", False)), int(codec.seed) & (2**64 - 1),
            float(getattr(codec, "ratio", 0.01)), bool(getattr(codec, "exact", False)),
            float(getattr(codec, "tolerance", 0.1)), float(getattr(codec, "sample_fraction", 0.01)),
            worker, server, async_op)
        self._stats["compressed_calls"] += 1
        self._stats["bytes_sent"] += work.bytes_sent
        self._stats["bytes_uncompressed"] += work.bytes_uncompressed
        return work if async_op else None

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

        Example::

            out = torch.empty(n); comm.reduce_scatter(out, torch.randn(world * n))
        """
        if not isinstance(input, torch.Tensor):
            input = torch.cat([t.reshape(-1) for t in input])
        algo, strict = self._algorithm(algorithm, REDUCE_SCATTER)
        op_id = self._op(op, REDUCE_SCATTER)
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
        algo, strict = self._algorithm(algorithm, ALL_GATHER)
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
        algo, strict = self._algorithm(algorithm, BROADCAST)
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

    # --------------------------------------------------------- point-to-point

    def send(
        self,
        tensor: Union[torch.Tensor, Sequence[torch.Tensor]],
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
    ) -> Optional[Work]:
        """Send a tensor (or a list of tensors, as one message) to rank ``dst`` of this host.

        Messages between two ranks arrive in the order they were sent; the
        receiver needs no shapes: each tensor travels with its dtype and shape.
        Returns once the data is in the channel (the receiver may not have it
        yet), or a Work that completes then. Only the two ranks take part:
        unlike collectives, other ranks need not call anything. Between hosts
        use ``torch.distributed.send``.

        ``tag`` is checked, not matched: a ``recv`` whose tag differs from the
        next message's raises :class:`pycomm.CommError` on both ranks.

        Example::

            if comm.rank == 0:
                comm.send(torch.randn(4, 8), dst=1)
            else:
                x = comm.recv(src=0)          # a float32 tensor of shape (4, 8)
        """
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        work = self._c.send(tensors, int(dst), _check_tag(tag), async_op)
        return work if async_op else None

    def recv(
        self,
        src: int,
        *,
        out: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None,
        tag: int = 0,
        async_op: bool = False,
    ) -> Union[torch.Tensor, List[torch.Tensor], Work]:
        """Receive the next message from rank ``src``: its tensor, or its list of tensors.

        With ``out`` (tensors of the dtypes and shapes sent) the data lands
        there; otherwise new tensors are allocated from the message. With
        ``async_op=True`` returns a Work whose ``result()`` (and future) holds
        the list of tensors.

        Example::

            x = comm.recv(src=0)
            work = comm.recv(src=0, async_op=True); work.wait(); x, = work.result()
        """
        outs = [] if out is None else ([out] if isinstance(out, torch.Tensor) else list(out))
        work = self._c.recv(outs, int(src), _check_tag(tag), async_op)
        if async_op:
            return work
        result = work.result()
        return result[0] if len(result) == 1 else result

    # ------------------------------------------------------------------- misc

    def resolve_algorithm(self, collective: str, algorithm: str, nbytes: int) -> str:
        """The concrete algorithm a call of ``nbytes`` per rank would run (e.g. what "auto" picks)."""
        algo, _ = self._algorithm(algorithm, COLLECTIVE_NAMES.index(collective))
        return self._c.resolve(COLLECTIVE_NAMES.index(collective), algo, int(nbytes))

    @property
    def timeout(self) -> float:
        """Seconds one collective may wait for a peer before raising CommError."""
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._c.timeout = float(seconds)

    def abort(self, reason: str = "aborted by the user") -> None:
        """Make the current and every later collective fail on every rank."""
        self._c.abort(f"pycomm: rank {self.rank}: {reason}")

    def close(self) -> None:
        """Finish queued collectives and leave; later calls raise CommError."""
        self._c.shutdown()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transport(self) -> str:
        """What carries the data: "shm", "process_group" or "shm+process_group"."""
        return self._c.transport

    def __repr__(self) -> str:
        return (f"pycomm.Communicator(rank={self.rank}, world_size={self.world_size}, hosts={self.num_hosts}, "
                f"local_size={self.local_size}, transport={self.transport!r})")


def restart_prefix() -> str:
    """Store keys of one attempt of an elastic job ("attempt<n>/"; "" outside torchrun).

    torchrun's store outlives a restart: without this, a restarted rank
    could read the previous attempt's token and look for its segment.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"attempt{attempt}/" if attempt else ""


def _wait_keys(store: "dist.Store", keys: List[str], timeout: float, what: str) -> None:
    """Store waits are bounded by the communicator's timeout, not the Store's."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # the Store raises its own timeout error types
        missing = [k for k in keys if not store.check([k])]
        ranks = [k.rsplit("/", 1)[-1] for k in missing if k.startswith("host/")]
        detail = f"; ranks {', '.join(ranks)} never arrived" if ranks else ""
        raise CommError(
            f"pycomm: bootstrap timed out after {timeout:g} s waiting for {what}{detail} "
            "(did every rank create the communicator?)"
        ) from e


def _env_size(name: str, default: int) -> int:
    env = os.environ.get(name)
    return parse_size(env) if env else default


def _inter_host_backend(group: Optional["dist.ProcessGroup"], store: "dist.Store", rank: int, world_size: int,
                        timeout: float):
    """The C++ backend object that will carry traffic between hosts."""
    if group is not None:
        if group.size() != world_size or group.rank() != rank:
            raise CommError(f"pycomm: inter_host_group has rank {group.rank()} of {group.size()}, but this "
                            f"communicator has rank {rank} of {world_size}; they must match")
        try:
            return group._get_backend(torch.device("cpu"))
        except Exception as e:
            raise CommError(f"pycomm: inter_host_group has no CPU backend ({e}); pass a gloo group") from e
    # A private Gloo group: its own connections and tags, so pycomm's traffic
    # never interleaves with the caller's collectives on other groups.
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                     datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise CommError(f"pycomm: could not connect the ranks through Gloo ({e}); between hosts set "
                        "GLOO_SOCKET_IFNAME to the interface the hosts share") from e


def _resolve_bootstrap(group, store, rank, world_size):
    if store is not None:
        if rank is None or world_size is None:
            raise CommError("pycomm: pass rank and world_size together with store")
        return store, int(rank), int(world_size), "store"
    if not (dist.is_available() and dist.is_initialized()):
        raise CommError(
            "pycomm: torch.distributed is not initialized; call dist.init_process_group(...) first "
            "or pass store=, rank=, world_size="
        )
    group = group or dist.group.WORLD
    name = getattr(group, "group_name", None) or str(id(group))
    return dist.distributed_c10d._get_default_store(), dist.get_rank(group), dist.get_world_size(group), name


# ------------------------------------------------------------------ default communicator

_default: Optional[Communicator] = None


def init(group: Optional["dist.ProcessGroup"] = None, **kwargs: object) -> Communicator:
    """Create the default communicator (used by the module-level functions).

    Example::

        dist.init_process_group("gloo")
        pycomm.init()
        pycomm.all_reduce(t)
    """
    global _default
    if _default is not None:
        raise CommError("pycomm: the default communicator already exists; call pycomm.destroy() first")
    _default = Communicator(group, **kwargs)
    return _default


def get_default() -> Communicator:
    """The default communicator, created from the default group on first use."""
    if _default is None:
        init()
    assert _default is not None
    return _default


def destroy() -> None:
    """Close and drop the default communicator."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


atexit.register(destroy)


def all_reduce(tensor: torch.Tensor, op: Op = "sum", **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return get_default().all_reduce(tensor, op, **kwargs)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Op = "sum", **kwargs) -> Optional[Work]:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return get_default().reduce_scatter(output, input, op, **kwargs)


def all_gather(output: torch.Tensor, input: torch.Tensor, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_gather` on the default communicator."""
    return get_default().all_gather(output, input, **kwargs)


def broadcast(tensor: torch.Tensor, src: int = 0, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return get_default().broadcast(tensor, src, **kwargs)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.all_to_all_single` on the default communicator."""
    return get_default().all_to_all_single(output, input, **kwargs)


def send(tensor: Union[torch.Tensor, Sequence[torch.Tensor]], dst: int, **kwargs) -> Optional[Work]:
    """:meth:`Communicator.send` on the default communicator."""
    return get_default().send(tensor, dst, **kwargs)


def recv(src: int, **kwargs) -> Union[torch.Tensor, List[torch.Tensor], Work]:
    """:meth:`Communicator.recv` on the default communicator."""
    return get_default().recv(src, **kwargs)


def barrier(**kwargs) -> Optional[Work]:
    """:meth:`Communicator.barrier` on the default communicator."""
    return get_default().barrier(**kwargs)
