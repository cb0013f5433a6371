"""The reliability suite's scenarios.

Trials that kill a rank need fresh processes every time. A *zygote* (one
process that has imported torch and pycomm) forks the ranks of each trial,
so a trial costs milliseconds of start-up instead of seconds of imports.
Everything here is plain functions: the zygote and the harness workers call
them by reference. About 580 lines: one module, so that the zygote
imports every scenario once before it forks.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import random
import resource
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import pycomm
from harness import free_port, make_comm, serve

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier"]
ALGOS = {"all_reduce": ["auto", "ring", "tree", "direct"], "reduce_scatter": ["auto", "ring", "direct"],
         "all_gather": ["auto", "ring", "direct"], "broadcast": ["auto", "ring", "tree", "direct"]}
# Small integers: sums over 8 ranks stay exact in every dtype, bfloat16 too,
# so every result is checked exactly.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
SIZES = [0, 1, 7, 1000, 16411, 70001, 262147]


def shm_entries() -> set:
    return {f for f in os.listdir("/dev/shm") if f.startswith("pycomm.")}


# --------------------------------------------------------------- checked stream


def _pattern(n: int, rank: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return ((torch.arange(n) * 7 + salt) % 5 + rank).to(dtype)


def _reduced(base: torch.Tensor, op: object, world: int) -> torch.Tensor:
    """The reduction over ranks r = 0..world-1 of base + r (what _pattern
    gives each rank), for op "sum", "avg", "max" or "min" in any spelling
    (a dist.ReduceOp too); unknown spellings count as sum."""
    name = str(op).lower()
    if "product" in name:
        out = base.clone()
        for r in range(1, world):
            out = out * (base + r)
        return out
    if "max" in name:
        return base + world - 1
    if "min" in name:
        return base
    total = base * world + world * (world - 1) // 2
    return total.double() / world if "avg" in name else total


def random_call(comm, rng: random.Random, rank: int, world: int, step: int,
                sizes: List[int] = SIZES) -> Optional[str]:
    """One random collective (the same on every rank: rng is seeded alike),
    checked exactly against its closed form; returns what was wrong, if anything."""
    coll = rng.choice(COLLECTIVES)
    n = rng.choice(sizes)
    dtype = rng.choice(DTYPES)
    algo = rng.choice(ALGOS.get(coll, ["auto"]))
    use_async = rng.random() < 0.3
    salt = step % 11

    def finish(work):
        if use_async:
            work.get_future().wait()

    if coll == "all_reduce":
        op = rng.choice(["sum", "max"])
        x = _pattern(n, rank, dtype, salt)
        finish(comm.all_reduce(x, op, algorithm=algo, async_op=use_async))
        want = _reduced(_pattern(n, 0, torch.int64, salt), op, world)
    elif coll == "reduce_scatter":
        x = torch.cat([_pattern(n, rank, dtype, salt + c) for c in range(world)])
        out = torch.empty(n, dtype=dtype)
        finish(comm.reduce_scatter(out, x, algorithm=algo, async_op=use_async))
        x, want = out, _reduced(_pattern(n, 0, torch.int64, salt + rank), "sum", world)
    elif coll == "all_gather":
        out = torch.empty(n * world, dtype=dtype)
        finish(comm.all_gather(out, _pattern(n, rank, dtype, salt), algorithm=algo, async_op=use_async))
        x, want = out, torch.cat([_pattern(n, r, torch.int64, salt) for r in range(world)])
    elif coll == "broadcast":
        root = step % world
        x = _pattern(n, rank, dtype, salt)
        finish(comm.broadcast(x, src=root, algorithm=algo, async_op=use_async))
        want = _pattern(n, root, torch.int64, salt)
    elif coll == "all_to_all":
        x = torch.cat([_pattern(n, rank * world + p, dtype, salt) for p in range(world)])
        out = torch.empty_like(x)
        finish(comm.all_to_all_single(out, x, async_op=use_async))
        x, want = out, torch.cat([_pattern(n, p * world + rank, torch.int64, salt) for p in range(world)])
    else:
        finish(comm.barrier(async_op=use_async))
        return None
    if dtype == torch.uint8:
        want = want % 256
    if not torch.equal(x.to(torch.int64), want):
        return f"step {step}: {coll}/{algo}/{dtype}/{n} gave a wrong result"
    return None


# ------------------------------------------------------------------- the zygote


def _zygote_main(conn) -> None:
    torch.set_num_threads(1)
    serve(conn)


class Zygote:
    """A process with torch and pycomm imported that runs trial functions;
    trials fork their ranks from it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_zygote_main, args=(child,), daemon=True)
        self.proc.start()

    def run(self, fn, *args: Any, timeout: float = 120, **kwargs: Any) -> Any:
        self.conn.send((fn, args, kwargs))
        if not self.conn.poll(timeout):
            raise AssertionError(f"trial did not finish within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(value)
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


# How fork_ranks starts ranks: "fork" (the default: milliseconds, from this
# zygote) or "spawn" (a fresh interpreter per rank: seconds of imports).
# ThreadSanitizer turns itself off in a child forked from a process that runs
# threads, so tests/sanitize.sh thread spawns them.
RANK_START = os.environ.get("PYCOMM_RANK_START", "fork")
# Seconds a rank may take to start and report "ready".
START_S = 60.0 if RANK_START == "fork" else 300.0


def _run_rank(target, r: int, world: int, port: int, conn, args: tuple) -> None:
    """A rank's whole life: target, then _exit (no exit handlers of the
    zygote it was forked from)."""
    code = 0
    try:
        target(r, world, port, conn, *args)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def _spawned_rank(fd: int) -> None:
    """Entry of a spawned rank: its call arrives pickled on stdin, its
    connection as an inherited descriptor."""
    target, r, world, port, args = pickle.load(sys.stdin.buffer)
    _run_rank(target, r, world, port, Connection(fd), args)


def _start_rank(target, r: int, world: int, port: int, child, args: tuple) -> int:
    if RANK_START == "fork":
        pid = os.fork()
        if pid == 0:
            _run_rank(target, r, world, port, child, args)
        return pid
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", f"import reliability_cases as rc; rc._spawned_rank({child.fileno()})"],
                            stdin=subprocess.PIPE, pass_fds=(child.fileno(),), env=env)
    proc.stdin.write(pickle.dumps((target, r, world, port, args)))
    proc.stdin.close()
    return proc.pid


_STORE_MAIN = """import time, torch.distributed as dist
_store = dist.TCPStore("127.0.0.1", {port}, {world}, is_master=True, wait_for_workers=False)
time.sleep(1e9)"""


def fork_ranks(world: int, target, *args: Any, duplex: bool = False, port: Optional[int] = None) -> tuple:
    """Forks a store process (the TCPStore's host, like torchrun's agent) on
    `port` (default: a free one) and `world` ranks running target(rank,
    world, port, conn, *args) (or spawns them all: RANK_START); returns
    (store pid, rank pids, connections). The connections carry the ranks'
    reports to the caller (and, with `duplex`, the caller's messages to the
    ranks)."""
    port = port or free_port()
    if RANK_START != "fork":
        store_pid = subprocess.Popen([sys.executable, "-c", _STORE_MAIN.format(port=port, world=world)]).pid
    else:
        store_pid = os.fork()
    if store_pid == 0:
        try:
            _store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # noqa: F841
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
    pids, conns = [], []
    for r in range(world):
        parent, child = mp.Pipe(duplex=duplex)
        pids.append(_start_rank(target, r, world, port, child, args))
        child.close()
        conns.append(parent)
    return store_pid, pids, conns


def reap(pids: List[int], deadline: float) -> List[int]:
    """Waits for every pid until `deadline`, then kills what is left; returns
    the pids that had to be killed (hangs)."""
    hung = []
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # a spawned rank's Popen reaped it
                break
            if done:
                break
            if time.monotonic() > deadline:
                hung.append(pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    return hung


def _bootstrap(rank: int, world: int, port: int, name: str, timeout: float, **comm_kwargs):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    return store, pycomm.Communicator(store=store, rank=rank, world_size=world, name=name, timeout=timeout,
                                      **comm_kwargs)


def _death_rank(rank: int, world: int, port: int, conn, seed: int, timeout: float, comm_kwargs: dict) -> None:
    store, comm = _bootstrap(rank, world, port, "death", timeout, **comm_kwargs)
    conn.send("ready")
    rng = random.Random(seed)
    ops, wrong = 0, []
    try:
        while True:
            bad = random_call(comm, rng, rank, world, ops)
            if bad:
                wrong.append(bad)
            ops += 1
    except Exception as e:  # noqa: BLE001 - what the survivor saw is the result
        conn.send(dict(err=f"{type(e).__name__}: {e}", t=time.monotonic(), ops=ops, wrong=wrong,
                       blamed=getattr(e, "blamed_rank", None), failure=getattr(e, "failure", None)))


def death_trial(world: int, seed: int, timeout: float, comm_kwargs: Optional[dict] = None) -> Dict[str, Any]:
    """kill -9 a random rank at a random moment of a random checked stream.

    Returns the victim, each survivor's report (error text, seconds from the
    kill to its error, ops done, wrong results), hung ranks and segments left
    in /dev/shm."""
    rng = random.Random(seed)
    victim = rng.randrange(world)
    delay = rng.uniform(0.0, 0.5)
    before = shm_entries()
    store_pid, pids, conns = fork_ranks(world, _death_rank, seed, timeout, comm_kwargs or {})
    start_deadline = time.monotonic() + START_S
    for c in conns:
        if not c.poll(max(0.0, start_deadline - time.monotonic())) or c.recv() != "ready":
            reap(pids + [store_pid], 0)
            raise AssertionError("a rank did not start")
    time.sleep(delay)
    t_kill = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    deadline = t_kill + timeout + 10
    reports = {}
    for r, c in enumerate(conns):
        if r == victim:
            continue
        if c.poll(max(0.0, deadline - time.monotonic())):
            rep = c.recv()
            rep["after_kill"] = rep.pop("t") - t_kill
            reports[r] = rep
        else:
            reports[r] = dict(err=None, after_kill=None, ops=None, wrong=[])
    hung = reap(pids, deadline)
    reap([store_pid], 0)
    return dict(victim=victim, delay=delay, reports=reports, hung=len(hung), leaked=sorted(shm_entries() - before))


# ------------------------------------------------------------------------ soak


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def soak(rank: int, world: int, name: str, calls: int, seed: int) -> Dict[str, Any]:
    """`calls` random checked collectives (plain and compressed, sync and
    async); RSS, open fds and /dev/shm sampled after a warm-up and at the end."""
    comm = make_comm(rank, world, name, timeout=60, round_bytes=64 * 1024)
    rng = random.Random(seed)
    ef = pycomm.ErrorFeedback()
    wrong: List[str] = []
    warm = min(300, calls // 4)
    samples = {}
    t0 = time.monotonic()
    for step in range(calls):
        if step == warm:
            samples["warm"] = (_rss_mb(), _fds(), len(shm_entries()))
        if rng.random() < 0.1:
            # Compressed all-reduce with error feedback: the result is within
            # the codec's bound of the exact mean (checked loosely here; the
            # compression suite checks the bounds themselves).
            n = rng.choice([1000, 5000])
            x = torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + step)) + rank
            exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + step)) + r
                        for r in range(world)) / world
            codec = rng.choice([pycomm.Int8(), pycomm.Int4(), pycomm.TopK(ratio=1.0)])
            comm.all_reduce(x, op="avg", compression=codec, error_feedback=ef, key=("k", n, type(codec).__name__))
            if not torch.isfinite(x).all() or (x - exact).abs().max() > 3 * exact.abs().max():
                wrong.append(f"step {step}: compressed all_reduce far from the mean")
        else:
            bad = random_call(comm, rng, rank, world, step, sizes=[0, 1, 7, 100, 1000, 16411, 70001])
            if bad:
                wrong.append(bad)
    samples["end"] = (_rss_mb(), _fds(), len(shm_entries()))
    comm.close()
    return dict(wrong=wrong, seconds=time.monotonic() - t0, **samples)


# ------------------------------------------------------------ isolation, stale


def two_jobs(rank: int, port_a: int, port_b: int, calls: int) -> List[str]:
    """Ranks 0-1 are job A, ranks 2-3 job B: separate stores, the same
    communicator name, different random streams, at the same time."""
    job, local = divmod(rank, 2)
    store = dist.TCPStore("127.0.0.1", (port_a, port_b)[job], 2, is_master=local == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    comm = pycomm.Communicator(store=store, rank=local, world_size=2, name="job", timeout=30)
    rng = random.Random(7 + job)
    wrong = []
    for step in range(calls):
        # Different salts per job: data crossing between jobs would be wrong.
        bad = random_call(comm, rng, local, 2, step + 1000 * job)
        if bad:
            wrong.append(bad)
    comm.close()
    return wrong


def creator_waits(rank: int, world: int, name: str, timeout: float) -> str:
    """Rank 1 cannot attach (it asks for another segment size), so rank 0
    waits with its segment visible until the timeout (for the test to
    inspect)."""
    try:
        make_comm(rank, world, name, timeout=timeout, round_bytes=64 * 1024 * (1 + rank))
        return "no error"
    except pycomm.CommError as e:
        return str(e)


def open_as_other_user(path: str, uid: int = 65534) -> str:
    """Tries to open `path` read-write from a child running as `uid`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(uid)
            os.setuid(uid)
            fd = os.open(path, os.O_RDWR)
            os.close(fd)
            msg = b"opened"
        except PermissionError:
            msg = b"denied"
        except Exception as e:  # noqa: BLE001
            msg = f"error {e}".encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 200).decode()
    os.close(r)
    return out


def stale_segment(rank: int, name: str, token: str, world: int = 2) -> Dict[str, str]:
    """A segment left behind by a job that crashed before its peers attached
    (a forked creator killed with -9), then: a creator of the same name, an
    attacher with another token, an attacher with the right one."""
    core = pycomm.load_core()
    args = dict(rank=0, world=world, timeout=5.0, local_rank=0, local_size=world, shm_name=name, round_bytes=65536)
    pid = os.fork()
    if pid == 0:
        try:
            core.Communicator(token=token, create=True, **args)
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    out = {"left behind": str(os.path.exists("/dev/shm" + name))}
    for label, kwargs in (("create again", dict(token="f" * 32, create=True)),
                          ("attach, other token", dict(token="f" * 32, create=False, rank=1, local_rank=1))):
        a = dict(args, **kwargs)
        try:
            core.Communicator(**a)
            out[label] = "attached"
        except Exception as e:  # noqa: BLE001
            out[label] = str(e)
    return out


# ---------------------------------------------------------------- fuzzing


FUZZ_DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8",
               "int8", "int16", "bool", "complex64"]
# Every fuzz dtype moves; these also reduce (int16 and complex64 are copy-only).
REDUCIBLE = {"float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "bool"}
# Element counts at and around the 64 KiB round and 256 KiB segment
# boundaries of a float32 tensor, split across world sizes 1-3.
FUZZ_SIZES = [0, 1, 2, 3, 5, 16383, 16384, 16385, 24577, 49151, 65535, 65536, 65537]
LAYOUTS = ["contiguous", "offset", "transposed", "strided", "expanded"]
OUTPUTS = ["in place", "separate", "wrong size", "wrong dtype", "overlap"]
GOOD_OPS = ["sum", "avg", "max", "min", "SUM", "product", "ReduceOp.SUM", "ReduceOp.AVG", "ReduceOp.PRODUCT"]
BAD_OPS = ["prod", "mul", 3]
OPS = GOOD_OPS + BAD_OPS
FUZZ_ALGOS = ["auto", "ring", "tree", "direct", "hierarchical", "butterfly", ""]
_fuzz_comms: Dict[str, Any] = {}


def _layout(n: int, dtype: torch.dtype, layout: str, device: str, rank: int, salt: int) -> torch.Tensor:
    """A tensor of n elements (values from _pattern) in the given layout."""
    if dtype in (torch.bool, torch.complex64):
        base = _pattern(n, rank, torch.int64, salt).to(dtype)
    else:
        base = _pattern(n, rank, dtype, salt)
    if device == "meta":
        return torch.empty(n, dtype=dtype, device="meta")
    if layout == "offset":  # contiguous, but not at the start of its storage
        buf = torch.empty(n + 3, dtype=dtype)
        buf[3:] = base
        return buf[3:]
    if layout == "transposed" and n % 2 == 0 and n >= 4:
        return base.view(2, n // 2).t().contiguous().t()
    if layout == "strided" and n > 1:
        buf = torch.empty(2 * n, dtype=dtype)
        buf[::2] = base
        return buf[::2]
    if layout == "expanded" and n > 1:
        return base[:1].expand(n)
    return base.clone()


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else torch.float64


def _op(op):
    if isinstance(op, str) and op.startswith("ReduceOp."):
        return getattr(dist.ReduceOp, op.split(".")[1])
    return op


def fuzz_one(rank: int, world: int, name: str, case: Dict[str, Any]) -> tuple:
    """Runs one fuzz case on this rank: ("ok", correct?) or ("err", type, message)."""
    comm = _fuzz_comms.get(name)
    if comm is None:
        comm = _fuzz_comms[name] = make_comm(rank, world, name, timeout=30, round_bytes=64 * 1024)
    coll, n, layout, device = case["coll"], case["n"], case["layout"], case["device"]
    dtype = getattr(torch, case["dtype"])
    salt = case["salt"]
    op = _op(case["op"])
    algo = case["algorithm"]
    try:
        if coll == "all_reduce":
            x = _layout(n, dtype, layout, device, rank, salt)
            kind = case["output"]
            out = None
            if kind == "separate":
                out = torch.empty(n, dtype=dtype, device=device)
            elif kind == "wrong size":
                out = torch.empty(n + 1, dtype=dtype, device=device)
            elif kind == "wrong dtype":
                out = torch.empty(n, dtype=_other_dtype(dtype), device=device)
            elif kind == "overlap" and n > 1 and x.is_contiguous() and device == "cpu":
                buf = torch.empty(n + 1, dtype=dtype)
                buf[:n] = x
                x, out = buf[:n], buf[1:]
            comm.all_reduce(x, op, output=out, algorithm=algo)
            res = x if out is None else out
            want = _reduced(_pattern(n, 0, torch.int64, salt), op, world)
        elif coll == "reduce_scatter":
            x = _layout(n * world, dtype, layout, device, rank, salt)
            m = n + (1 if case["output"] == "wrong size" else 0)
            odt = _other_dtype(dtype) if case["output"] == "wrong dtype" else dtype
            res = torch.empty(m, dtype=odt, device=device)
            comm.reduce_scatter(res, x, op, algorithm=algo)
            want = _reduced(_pattern(n * world, 0, torch.int64, salt)[rank * n:(rank + 1) * n], op, world)
        elif coll == "all_gather":
            x = _layout(n, dtype, layout, device, rank, salt)
            m = n * world + (1 if case["output"] == "wrong size" else 0)
            odt = _other_dtype(dtype) if case["output"] == "wrong dtype" else dtype
            res = torch.empty(m, dtype=odt, device=device)
            comm.all_gather(res, x, algorithm=algo)
            want = torch.cat([_pattern(n, r, torch.int64, salt) for r in range(world)])
        elif coll == "broadcast":
            root = case["root"]
            res = _layout(n, dtype, layout, device, rank, salt)
            comm.broadcast(res, src=root, algorithm=algo)
            want = _pattern(n, root, torch.int64, salt)
        else:  # all_to_all
            res = torch.empty(n, dtype=dtype, device=device)
            x = _layout(n, dtype, layout, device, rank, salt)
            comm.all_to_all_single(res, x)
            k = n // world
            want = torch.cat([_pattern(n, p, torch.int64, salt)[rank * k:(rank + 1) * k] for p in range(world)])
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        return ("err", type(e).__name__, str(e))
    if dtype == torch.uint8:
        want = want % 256
    if dtype == torch.bool:  # bool reductions are logical: OR for sum and max, AND for min and product
        want = want != 0
    if res.is_complex():  # the patterns are real
        res = res.real
    if res.dtype.is_floating_point:
        # Sums of small integers are exact in every float dtype; an average
        # is rounded once to the tensor's dtype.
        rtol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(res.dtype, 1e-6)
        return ("ok", bool(torch.allclose(res.double(), want.double(), rtol=rtol, atol=0)))
    return ("ok", bool(torch.equal(res.to(torch.int64), want.to(torch.int64))))


def fuzz_problems(case: Dict[str, Any], world: int) -> List[str]:
    """What is wrong with a fuzz case: for each problem, a word its error
    message contains. Empty when the call is valid and must succeed."""
    coll, n = case["coll"], case["n"]
    dtype = getattr(torch, case["dtype"])
    problems = []
    if coll != "all_to_all":
        if case["algorithm"] not in ("auto", "ring", "tree", "direct", "hierarchical"):
            problems.append("unknown algorithm")
        elif case["algorithm"] == "tree" and coll in ("reduce_scatter", "all_gather"):
            problems.append("not available")
    op = case["op"]
    opname = op.lower().replace("reduceop.", "") if isinstance(op, str) else None
    if coll in ("all_reduce", "reduce_scatter"):
        if opname not in ("sum", "avg", "max", "min", "product"):
            problems.append("unsupported reduce op")
        elif case["dtype"] not in REDUCIBLE:
            problems.append("reductions take")
        elif opname == "avg" and not dtype.is_floating_point:
            problems.append("floating-point")
    if case["device"] == "meta":
        problems.append("device")
    size = n * world if coll == "reduce_scatter" else n
    if not _layout(size, dtype, case["layout"], case["device"], 0, 0).is_contiguous():
        problems.append("not contiguous")
    if coll in ("all_reduce", "reduce_scatter", "all_gather"):
        if case["output"] == "wrong size":
            problems.append("elements")
        elif case["output"] == "wrong dtype":
            problems.append("dtype")
        elif coll == "all_reduce" and case["output"] == "overlap" and n > 1 and case["device"] == "cpu":
            problems.append("overlap")
    if coll == "broadcast" and not 0 <= case["root"] < world:
        problems.append("src=")
    if coll == "all_to_all" and n % world:
        problems.append("split evenly")
    return problems
