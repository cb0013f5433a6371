"""How a communicator comes up: rendezvous through a ``torch.distributed`` Store.

pycomm has no rendezvous of its own: ranks meet through a Store (the default
group's, or one you pass), agree on a random per-job token, find which ranks
share a host, and map one shared-memory segment per host. Between hosts the
data travels through a ``torch.distributed`` process group (a private Gloo
group built on the same Store, or one you pass).

Example::

    store = dist.TCPStore("127.0.0.1", 29500, 2, rank == 0)
    comm = pycomm.Communicator(store=store, rank=rank, world_size=2)   # runs connect() below
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _env
from ._loader import CommError, load_core
from ._version import __version__

logger = logging.getLogger("pycomm")

TRANSPORTS = ("auto", "shm", "pg")
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


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: hosts are numbered by their lowest rank, local ranks by rank."""

    rank: int
    world_size: int
    host: int
    num_hosts: int
    local_rank: int
    local_size: int
    host_ranks: List[List[int]]
    #: What a successor communicator (shrink, admit) passes to find these
    #: hosts again: the host label given, ``h<host>`` for a layout simulated
    #: with ``local_size``, None for real hosts (found again by name).
    label: Optional[str] = None


def restart_prefix() -> str:
    """Store keys of one attempt of an elastic job ("attempt<n>/"; "" outside torchrun).

    torchrun's store outlives a restart: without this, a restarted rank
    could read the previous attempt's token and look for its segment.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"attempt{attempt}/" if attempt else ""


def key_space(store: "dist.Store", name: str, sub: str = "") -> "dist.Store":
    """The Store keys of communicator ``name`` in this attempt of the job
    (``sub``: a part of them), as every rank sees them.

    Example::

        key_space(store, comm.name, "elastic/a0/")   # pycomm/<name>/[attempt<n>/]elastic/a0/...
    """
    return dist.PrefixStore(f"pycomm/{name}/{restart_prefix()}{sub}", store)


def _proc_stat(pid: int) -> Optional[Tuple[str, str]]:
    """(state, start time in clock ticks) of process ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], fields[19]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def process_record() -> str:
    """This process as a peer on its host can check it (JSON): host key, pid
    namespace, pid and start time (which tells a reused pid apart).

    Example::

        store.set(f"proc/{rank}", process_record())
    """
    stat = _proc_stat(os.getpid())
    return json.dumps(dict(host=_host_key(), pidns=_pid_namespace(), pid=os.getpid(), start=stat[1] if stat else ""))


def process_gone(record: str) -> Optional[str]:
    """Whether the process of ``record`` (:func:`process_record`) is gone:
    "died" (no such process, another one under its pid, or a zombie),
    "stopped" (SIGSTOP, a debugger), or None when it runs or lives on another
    host or in another pid namespace (it cannot be seen from here)."""
    try:
        rec = json.loads(record)
    except (TypeError, ValueError):
        return None
    if not isinstance(rec, dict) or "pid" not in rec:
        return None
    if rec.get("host") != _host_key() or rec.get("pidns") != _pid_namespace():
        return None
    stat = _proc_stat(int(rec["pid"]))
    if stat is None or (rec.get("start") and stat[1] != rec["start"]) or stat[0] in ("Z", "X"):
        return "died"
    return "stopped" if stat[0] in ("T", "t") else None


#: Where the ranks of a successor communicator (pycomm.elastic) agree
#: whether every one of them built it, under the communicator's keys:
#: "failed" there ends every rank's bootstrap wait at once.
BUILD_VERDICT_KEY = "built/verdict"


class BootstrapWatch:
    """Tells a bootstrap when a peer on this host has died, or stayed stopped
    longer than ``stopped_after`` seconds, so that it gives up at once
    instead of at its timeout (a replacement killed while it joins, a member
    killed during a shrink: without this, every other rank waited 30 s).

    Each rank publishes :func:`process_record` under ``proc/<rank>`` when it
    starts; ``known`` gives records of ranks read elsewhere (a joiner's from
    its ticket), so a rank that dies before it starts is seen too. Peers on
    other hosts cannot be checked from here: a bootstrap waiting for one
    waits for its timeout.
    """

    #: Seconds between two checks while a bootstrap waits.
    INTERVAL_S = 0.02

    def __init__(self, store: "dist.Store", rank: int, world_size: int, stopped_after: float,
                 known: Optional[Dict[int, str]] = None) -> None:
        self._store, self._stopped_after = store, float(stopped_after)
        self._records: Dict[int, Optional[str]] = {r: v for r, v in (known or {}).items() if r != rank}
        self._unread = [r for r in range(world_size) if r != rank and r not in self._records]
        self._stopped_since: Dict[int, float] = {}
        self._next = 0.0

    def due(self) -> bool:
        """Whether :meth:`check` should run now (every INTERVAL_S)."""
        return time.monotonic() >= self._next

    def check(self) -> Optional[str]:
        """Why the bootstrap should give up ("rank 3 (pid 1234) died"), or None."""
        now = time.monotonic()
        self._next = now + self.INTERVAL_S
        if self._store.check([BUILD_VERDICT_KEY]) and self._store.get(BUILD_VERDICT_KEY) == b"failed":
            return "another rank gave this communicator up"
        for r in list(self._unread):
            if self._store.check([f"proc/{r}"]):
                self._records[r] = self._store.get(f"proc/{r}").decode()
                self._unread.remove(r)
        for r, rec in self._records.items():
            why = process_gone(rec) if rec else None
            if why == "stopped":
                since = self._stopped_since.setdefault(r, now)
                if now - since < self._stopped_after:
                    continue
                why = f"stopped for {now - since:.1f} s"
            else:
                self._stopped_since.pop(r, None)
            if why:
                self._records[r] = None  # judged once
                return f"rank {r} (pid {json.loads(rec)['pid']}) {why}"
        return None


def peer_lost(error: CommError) -> CommError:
    """``error``, marked as a bootstrap that ended because a peer was lost
    (seen dead or stopped, or another rank gave the build up): retrying
    with the ranks that remain can succeed (``error.peer_lost``)."""
    error.peer_lost = True
    return error


def wait_keys(store: "dist.Store", keys: List[str], timeout: float, what: str,
              watch: Optional[BootstrapWatch] = None) -> None:
    """Waits for ``keys``, bounded by the communicator's timeout, not the Store's,
    and by ``watch``: a peer seen dead or stopped ends the wait at once.

    Raises :class:`pycomm.CommError` naming ``what`` (and the ranks that
    never arrived, for ``host/<rank>`` keys).
    """
    try:
        if watch is None:
            store.wait(keys, datetime.timedelta(seconds=timeout))
            return
        # Polled, not one long wait: the watch must run meanwhile (and a
        # Store wait that times out is not free: it logs and reconnects).
        deadline, pause = time.monotonic() + timeout, 0.0005
        while not store.check(keys):
            if watch.due():
                why = watch.check()
                if why:
                    raise peer_lost(CommError(f"pycomm: bootstrap: gave up waiting for {what}: {why}"))
            if time.monotonic() >= deadline:
                raise TimeoutError
            time.sleep(pause)
            pause = min(pause * 1.5, 0.005)
    except CommError:
        raise
    except Exception as e:  # the Store raises its own timeout error types
        try:
            missing = [k for k in keys if not store.check([k])]
        except Exception:  # noqa: BLE001 - the Store itself is gone: say so below
            raise CommError(f"pycomm: bootstrap: the Store cannot be reached ({type(e).__name__}: {e})") from e
        ranks = [k.rsplit("/", 1)[-1] for k in missing if k.startswith("host/")]
        detail = f"; ranks {', '.join(ranks)} never arrived" if ranks else ""
        raise CommError(
            f"pycomm: bootstrap: Timed out waiting {round(timeout * 1000)}ms for {what}{detail} "
            "(did every rank create the communicator?)"
        ) from e


def resolve_group(group: Optional["dist.ProcessGroup"], store: Optional["dist.Store"], rank: Optional[int],
                  world_size: Optional[int]) -> Tuple["dist.Store", int, int, str]:
    """(store, rank, world_size, group name) from an explicit Store or a torch.distributed group."""
    if store is not None:
        if rank is None or world_size is None:
            raise CommError("pycomm: pass rank and world_size together with store")
        world_size = _env.check_whole(world_size, "world_size", minimum=1)
        rank = _env.check_whole(rank, "rank", minimum=0)
        if rank >= world_size:
            raise CommError(f"pycomm: rank={rank} is not a rank of a world of {world_size} (0..{world_size - 1})")
        return store, rank, world_size, "store"
    if not (dist.is_available() and dist.is_initialized()):
        raise CommError(
            "pycomm: torch.distributed is not initialized; call dist.init_process_group(...) first "
            "or pass store=, rank=, world_size="
        )
    group = group or dist.group.WORLD
    name = getattr(group, "group_name", None) or str(id(group))
    rank = dist.get_rank(group)
    if rank < 0:
        raise CommError(f"pycomm: this process (rank {dist.get_rank()}) is not a member of the group "
                        f"{dist.get_process_group_ranks(group)}; only its members build its communicator")
    return dist.distributed_c10d._get_default_store(), rank, dist.get_world_size(group), name


def _host_key() -> str:
    """Ranks with equal keys share memory: same kernel boot, network namespace
    and ``/dev/shm``.

    The network namespace matters for the simulated multi-host testbed, where
    ranks in separate namespaces of one machine must count as separate hosts.
    ``/dev/shm`` for containers on one machine that share its hostname and
    network (``--network host``) but not its IPC (no ``--ipc=host``): each has
    a /dev/shm of its own, where the others' segments cannot be opened, so
    they talk through the process group, as NCCL's shared-memory transport
    decides by the same device.
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
    try:
        shm = os.stat("/dev/shm")
        shm_id = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        shm_id = "?"
    return f"{socket.gethostname()}|{boot}|{netns}|{shm_id}"


# Between a rank's host key and its build in the Store (no host key holds it).
_BUILD_SEP = "\x1f"


def _build() -> str:
    """What ranks must share to talk: pycomm's version and the core's wire format."""
    return f"pycomm {__version__} (wire version {load_core().wire_version})"


def _ranks_text(ranks: List[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def bind_cores(local_rank: int, local_size: int) -> Optional[List[int]]:
    """Binds every thread of this process to local rank ``local_rank``'s
    share of the CPUs it may run on (``local_size`` equal, disjoint shares,
    in CPU order), as DeepSpeed's ``--bind_cores_to_rank`` does; returns the
    CPUs, or None (and logs why) when there are fewer CPUs than local ranks.

    Why: left to the scheduler, two ranks' busy threads can share one core
    for a whole process lifetime. Measured on 2 cores, 2 ranks: about half of
    fresh launches ran the all-reduce at 7 GB/s instead of 17-27 GB/s
    (1 MB to 16 MB); with each rank on its own core, every launch was fast
    (benchmarks/RESULTS.md).

    Example::

        pycomm.bootstrap.bind_cores(comm.local_rank, comm.local_size)
    """
    allowed = sorted(os.sched_getaffinity(0))
    if local_size > len(allowed):
        logger.info("pycomm: not binding cores: %d local ranks share %d CPUs", local_size, len(allowed))
        return None
    share = len(allowed) // local_size
    cpus = allowed[local_rank * share:(local_rank + 1) * share]
    # sched_setaffinity(0) binds the calling thread only: bind every thread
    # this process already has (torch's pools, pycomm's progress thread);
    # threads started later inherit the caller's.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended
    os.sched_setaffinity(0, cpus)
    return cpus


def exchange_topology(store: "dist.Store", rank: int, world_size: int, timeout: float,
                      local_size: Optional[int], host_label: Optional[str] = None,
                      watch: Optional[BootstrapWatch] = None) -> Topology:
    """Which ranks share a host: every rank publishes its host key and reads everyone's.

    ``local_size`` (or ``PYCOMM_LOCAL_SIZE``) pretends consecutive blocks of
    that many ranks are hosts (tests, benchmarks of a multi-host layout).
    ``host_label`` splits hosts further: ranks share a host only if their
    labels match too (a shrunk communicator keeps its parent's hosts, which
    may have been simulated).
    """
    store.set(f"host/{rank}", _host_key() + (f"#{host_label}" if host_label else "") + _BUILD_SEP + _build())
    keys = [f"host/{r}" for r in range(world_size)]
    wait_keys(store, keys, timeout, "every rank to join", watch)
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    hosts, builds = zip(*(v.decode().rpartition(_BUILD_SEP)[::2] for v in values))
    hosts = list(hosts)
    if len(set(builds)) > 1:
        # Every rank reads the same values, so every rank raises, naming the same ranks.
        by_build: Dict[str, List[int]] = {}
        for r, b in enumerate(builds):
            by_build.setdefault(b, []).append(r)
        said = "; ".join(f"{_ranks_text(rs)} {'run' if len(rs) > 1 else 'runs'} {b}" for b, rs in by_build.items())
        raise CommError(f"pycomm: the ranks run builds of pycomm that cannot talk to each other: {said}. "
                        "Install the same pycomm on every host")
    if local_size is None:
        local_size = _env.whole("PYCOMM_LOCAL_SIZE", None, minimum=1)
    simulated = local_size is not None and not host_label
    if simulated:
        n = int(local_size)
        if n <= 0 or world_size % n:
            raise CommError(f"pycomm: local_size={n} must divide the world size {world_size}")
        hosts = [f"{h}#block{r // n}" for r, h in enumerate(hosts)]
    host_keys = sorted(set(hosts), key=hosts.index)
    host_ranks = [[r for r in range(world_size) if hosts[r] == k] for k in host_keys]
    host = host_keys.index(hosts[rank])
    return Topology(rank=rank, world_size=world_size, host=host, num_hosts=len(host_keys),
                    local_rank=host_ranks[host].index(rank), local_size=len(host_ranks[host]),
                    host_ranks=host_ranks, label=host_label or (f"h{host}" if simulated else None))


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


def _unlink_segment(shm_name: str) -> None:
    """Removes a shared segment's name (``shm_unlink``: its file in /dev/shm), if it exists."""
    try:
        os.unlink(f"/dev/shm{shm_name}")
    except OSError:
        pass


def connect(store: "dist.Store", rank: int, world_size: int, *, timeout: float, round_bytes: Optional[int],
            transport: str, local_size: Optional[int],
            inter_host_group: Optional["dist.ProcessGroup"], host_label: Optional[str] = None,
            stopped_after: Optional[float] = None, known_peers: Optional[Dict[int, str]] = None
            ) -> Tuple[Any, Topology, Optional[Any]]:
    """Builds this rank's compiled communicator; every rank calls it with the same ``store`` prefix.

    A peer on this host that dies, or stays stopped ``stopped_after`` seconds
    (default: ``PYCOMM_HEARTBEAT_S``, else 5), while the others wait for it
    ends the bootstrap at once on every rank that waits (:class:`BootstrapWatch`;
    ``known_peers``: records of ranks read elsewhere).

    Returns the core communicator, the topology and the private Gloo group
    between hosts it made (None without one, or with ``inter_host_group``).
    Raises CommError on a bad setting or a bootstrap that times out.
    """
    core = load_core()
    _env.whole("PYCOMM_SPIN_US", None, minimum=0)  # read by the extension (transport/shm.cpp): checked here
    if transport not in TRANSPORTS:
        raise CommError(f"pycomm: transport={transport!r} is not one of {', '.join(TRANSPORTS)}")

    # 1. Topology: which ranks share a host; first, how peers can tell that
    #    this process died.
    store.set(f"proc/{rank}", process_record())
    if stopped_after is None:
        stopped_after = _env.seconds("PYCOMM_HEARTBEAT_S", 5.0, zero_ok=True) or timeout
    watch = BootstrapWatch(store, rank, world_size, stopped_after, known_peers)
    topo = exchange_topology(store, rank, world_size, timeout, local_size, host_label, watch)
    if transport == "shm" and topo.num_hosts > 1:
        raise CommError(f"pycomm: transport='shm' cannot connect the {topo.num_hosts} hosts of this job; "
                        "use 'auto'")
    use_shm = transport != "pg"
    use_pg = transport == "pg" or topo.num_hosts > 1
    local_ranks = topo.host_ranks[topo.host]

    # 2. One random token per job: segment names nobody can guess, and a
    #    check that we attach to this job's segment and no other.
    if rank == 0:
        store.set("token", secrets.token_hex(16))
    wait_keys(store, ["token"], timeout, "rank 0 to publish the job token", watch)
    token = store.get("token").decode()
    shm_name = f"/pycomm.{token}.{min(local_ranks)}"
    key = f"segment/{min(local_ranks)}"
    if round_bytes is None:
        round_bytes = _env.size("PYCOMM_SHM_ROUND_BYTES", DEFAULT_ROUND_BYTES)
    else:
        round_bytes = _env.check_whole(round_bytes, "round_bytes", minimum=1)
    round_bytes = max(64 * 1024, int(round_bytes) // 4096 * 4096)

    # 3. Between hosts: a process group (built before the segment, so a rank
    #    that fails here leaves no segment behind).
    backend = _inter_host_backend(inter_host_group, store, rank, world_size, timeout) if use_pg else None
    args = dict(rank=rank, world=world_size, timeout=timeout, use_shm=use_shm, local_rank=topo.local_rank,
                local_size=topo.local_size, shm_name=shm_name, token=token, round_bytes=round_bytes,
                host=topo.host, host_ranks=topo.host_ranks if use_pg else [], backend=backend,
                pg_round_bytes=_env.size("PYCOMM_PG_ROUND_BYTES", DEFAULT_PG_ROUND_BYTES),
                pg_window=_env.whole("PYCOMM_PG_WINDOW", DEFAULT_PG_WINDOW, minimum=1),
                store=store if use_pg else None, p2p_bytes=_env.size("PYCOMM_P2P_BYTES", DEFAULT_P2P_BYTES))

    # 4. The host's first rank creates the segment, the others attach.
    if not use_shm:
        c = core.Communicator(**args)
    elif topo.local_rank == 0:
        try:
            c = core.Communicator(create=True, **args)
        except Exception as e:
            store.set(key, f"error: {e}")
            raise
        store.set(key, "ok")
    else:
        try:
            wait_keys(store, [key], timeout, f"rank {min(local_ranks)} to create the shared segment", watch)
        except CommError:
            # The creator may have made the segment and died (or stalled)
            # before saying so: no rank will map it, so the last one to map
            # it will never remove its name. The name is this bootstrap's
            # alone (a fresh token), so removing it cannot hit another's.
            _unlink_segment(shm_name)
            raise
        status = store.get(key).decode()
        if status != "ok":
            raise CommError(f"pycomm: rank {min(local_ranks)} could not create the shared segment: {status}")
        c = core.Communicator(create=False, **args)
    # Return only once every local rank has mapped the segment (which is
    # then unlinked): a fast rank must not leave before a slow one joined;
    # nor wait out the timeout for one that died before it attached, or
    # after every other rank gave the build up.
    deadline = time.monotonic() + timeout
    while not c.wait_ready_for(BootstrapWatch.INTERVAL_S):
        why = watch.check()
        if why or time.monotonic() >= deadline:
            attached = c.abandon_ready()
            if why:
                raise peer_lost(CommError(f"pycomm: bootstrap: gave up waiting for the local ranks to map the shared "
                                          f"segment ({attached} of {topo.local_size} did): {why}"))
            raise CommError(f"pycomm: only {attached} of {topo.local_size} local ranks joined the shared memory "
                            f"segment within {timeout:g} s (did every rank create the communicator?)")
    return c, topo, (backend if inter_host_group is None else None)
