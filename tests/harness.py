"""Multi-process harness: worker processes are started once per test module
(importing torch costs seconds) and run many cases each. They fork from a
server that imported torch and pycomm once per test session, so a pool of 8
starts in a fraction of a second instead of ~15 s on 2 cores.

The pytest process hosts a TCPStore; each case builds its communicators
under a fresh name, so cases never share keys or segments.
"""
from __future__ import annotations

import datetime
import faulthandler
import gc
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def no_private_mounts() -> Optional[str]:
    """Why this machine cannot give a test's processes a /dev/shm of their own
    (root and ``unshare -m`` are needed), or None when it can."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare: a private /dev/shm"
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return "mount namespaces unavailable here"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_all(cmds: Sequence[Sequence[str]], inputs: Optional[Sequence[str]] = None,
                cwd: Optional[str] = None) -> List[Tuple[int, str]]:
    """Runs compiler commands side by side, one per core (each given its
    ``inputs`` entry on stdin, if any): (returncode, stderr) per command, in
    order. The C++ and CUDA build checks compile dozens of files this way."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> Tuple[int, str]:
        r = subprocess.run(list(cmds[i]), input=inputs[i] if inputs else None, capture_output=True, text=True,
                           cwd=cwd)
        return r.returncode, r.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(one, range(len(cmds))))


def run_script(name: str, *args: str, timeout: float) -> str:
    """Runs tests/<name> in a fresh interpreter (its own session, one OpenMP
    thread, the package on its path) and returns its output; a run past
    ``timeout`` is killed, with its whole process group, and fails the test."""
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, os.path.join(here, name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR"))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} {' '.join(args)} hung:\n{out}")
    assert proc.returncode == 0, out
    return out


_STATE: dict = {}  # per worker process: its Store client


class RankError(AssertionError):
    """A worker raised; carries every failing rank's traceback."""


def _worker_main(rank: int, port: int, conn, environ: Optional[dict] = None) -> None:
    if environ is not None:
        # Forked from the server, which holds the environment of the moment it
        # started: the test's as it is now instead, as a spawned worker has.
        os.environ.clear()
        os.environ.update(environ)
    # A rank that hangs is asked for every thread's stack (RankPool.stacks).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Up to 8 ranks share 2 cores: torch's own intra-op thread pool (whose
    # threads busy-wait) would turn every reference computation into a fight
    # for the cores.
    torch.set_num_threads(1)

    import pycomm  # noqa: F401

    # What the imports created lives as long as the process: moved out of the
    # collector's reach, so that the full collections the cases' many tensors
    # trigger no longer walk torch's few hundred thousand objects each time.
    gc.freeze()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    _STATE["store"] = store
    serve(conn, rank)
    # Not left to the interpreter's exit: a Gloo group torn down there may
    # abort the process (a worker thread that needs the GIL then).
    if dist.is_initialized():
        dist.destroy_process_group()


def serve(conn, *lead: Any) -> None:
    """Runs fn(*lead, *args) for each (fn, args, kwargs) received, sending
    back ("ok", result) or ("err", traceback), until None arrives."""
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*lead, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


_names = itertools.count()


def worker_store():
    """The TCPStore client of this worker process."""
    return _STATE["store"]


def all_reached(rank: int, world: int, key: str, timeout_s: float = 30.0) -> None:
    """Waits until ranks 0..world-1 all reached ``key``, through the pool's
    Store (no collective: the communicators under test may be aborted);
    raises after ``timeout_s``. Polls rather than ``store.wait``: a blocking
    call on the store object a communicator was built from holds up its
    heartbeats between hosts, and its peers would declare this rank silent."""
    store = worker_store()
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank of {world} reached {key!r} within {timeout_s} s")
        time.sleep(0.005)


def join_default_group(rank: int, world: int, name: str) -> None:
    """Joins this worker to a default Gloo group of the pool's ranks (once per worker)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore(name, worker_store()), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))


def make_comm(rank: int, world: int, name: str, **kwargs: Any):
    """A pycomm.Communicator over ranks 0..world-1 of the pool (call inside a worker)."""
    import pycomm

    return pycomm.Communicator(store=worker_store(), rank=rank, world_size=world, name=name, **kwargs)


class RankPool:
    """``nprocs`` long-lived worker processes; ``run`` calls a module-level
    function ``fn(rank, *args)`` on ranks ``0..world-1`` and returns the
    results in rank order."""

    def __init__(self, nprocs: int, env: Optional[dict] = None) -> None:
        """Workers fork from the session's server (torch and pycomm imported
        there once, no thread started: safe to fork), and take the test's
        environment as it is now. With ``env`` (variables that torch or pycomm
        may read as they are imported), PYCOMM_RANK_START=spawn or a GPU, each
        worker starts in a fresh interpreter instead (seconds per worker)."""
        self.nprocs = nprocs
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        # PYCOMM_RANK_START=spawn (tests/sanitize.sh thread): ThreadSanitizer
        # turns itself off in a forked child, as for the zygote's ranks. With
        # a GPU, as before: whatever the server's imports do to CUDA, a child
        # forked after CUDA was initialised cannot use it (and with the GPU
        # machine's 16 cores fresh interpreters start side by side anyway).
        fresh = bool(env) or os.environ.get("PYCOMM_RANK_START") == "spawn" or torch.cuda.is_available()
        ctx = mp.get_context("spawn" if fresh else "forkserver")
        if not fresh:
            ctx.set_forkserver_preload(["torch", "pycomm", "harness"])
        environ = None if fresh else dict(os.environ)
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.conns, self.procs = [], []
            for r in range(nprocs):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(r, self.port, child, environ), daemon=True)
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stacks(self, rank: int) -> str:
        """Where rank ``rank`` is: its native stacks when py-spy is installed;
        its Python stacks (faulthandler, on the worker's stderr) otherwise."""
        pid = self.procs[rank].pid
        if shutil.which("py-spy"):
            try:
                return subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError) as e:
                return f"py-spy failed: {e}"
        os.kill(pid, signal.SIGUSR1)
        sys.stderr.flush()
        return f"(rank {rank}'s Python stacks are on its stderr)"

    def new_name(self, prefix: str = "case") -> str:
        return f"{prefix}{next(_names)}"

    def run(self, fn: Callable, *args: Any, world: Optional[int] = None, timeout: float = 300,
            **kwargs: Any) -> List[Any]:
        """Results in rank order; raises RankError if any rank raised or died."""
        out = self.run_expect(fn, *args, world=world, timeout=timeout, **kwargs)
        dead = [r for r, (status, _) in enumerate(out) if status == "dead"]
        if dead:
            raise RankError(f"rank(s) {dead} died")
        errors = [f"--- rank {r}:\n{value}" for r, (status, value) in enumerate(out) if status == "err"]
        if errors:
            raise RankError("\n".join(errors))
        return [value for _, value in out]

    def run_expect(self, fn: Callable, *args: Any, world: Optional[int] = None, timeout: float = 300,
                   report_hangs: bool = False, **kwargs: Any) -> List[tuple]:
        """(status, value) per rank: ("ok", result), ("err", traceback) or ("dead", None).

        A rank that does not answer within ``timeout`` raises RankError, or
        with ``report_hangs`` is reported as ("hung", None) beside what the
        others said (a rank that hangs often waits for one that raised); the
        pool is then unusable until that rank answers."""
        world = self.nprocs if world is None else world
        for r in range(world):
            self.conns[r].send((fn, args, kwargs))
        out = []
        for r in range(world):
            if not self.conns[r].poll(timeout):
                if report_hangs:
                    out.append(("hung", self.stacks(r)))
                    continue
                raise RankError(f"rank {r} did not answer within {timeout} s (hang?)\n{self.stacks(r)}")
            try:
                out.append(self.conns[r].recv())
            except EOFError:
                out.append(("dead", None))
        return out

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive():
                    c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
