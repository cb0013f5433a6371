"""Worker-side API scenarios (run inside harness workers)."""
from __future__ import annotations

import datetime
import os
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist

import pycomm
from harness import make_comm, worker_store


def async_and_futures(rank: int, world: int, name: str) -> dict:
    comm = make_comm(rank, world, name, timeout=30)
    out = {}
    # Many async ops of different kinds and sizes in flight, then a sync op:
    # all complete in issue order with the right values.
    tensors = [torch.full((n,), float(rank + 1)) for n in (1, 1000, 100_000, 5, 70_000)]
    works = [comm.all_reduce(t, async_op=True, algorithm=a) for t, a in zip(tensors, ["ring", "tree", "direct", "auto", "ring"])]
    g = torch.empty(world * 3)
    works.append(comm.all_gather(g, torch.full((3,), float(rank)), async_op=True))
    b = torch.full((10,), float(rank))
    comm.broadcast(b, src=world - 1)  # synchronous, queued behind the async ones
    out["sync_after_async"] = bool((b == world - 1).all())
    for w in works:
        assert w.wait() is True
    s = world * (world + 1) / 2
    out["async_values"] = all(bool((t == s).all()) for t in tensors)
    out["gather"] = g.tolist() == [float(r) for r in range(world) for _ in range(3)]
    out["completed"] = all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
    out["seq_increasing"] = [w.seq for w in works] == sorted(w.seq for w in works)
    # get_future(): a torch.futures.Future holding [output], usable with then().
    t = torch.full((64,), float(rank))
    work = comm.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    # The same future type torch.distributed's Work.get_future() returns (and
    # DDP comm hooks hand back): torch.futures.Future is its Python subclass.
    out["future_type"] = isinstance(fut, torch._C.Future) and type(fut) is type(
        torch.futures.collect_all([]))
    out["future_value"] = bool((fut.wait()[0] == world - 1).all())
    out["then_value"] = bool((chained.wait() == 2 * (world - 1)).all())
    out["future_is_output"] = fut.value()[0].data_ptr() == t.data_ptr()
    out["algorithm_name"] = comm.all_reduce(torch.ones(3), algorithm="tree", async_op=True).algorithm
    # Lists, dist.ReduceOp, out of place.
    lst = [torch.empty(2) for _ in range(world)]
    comm.all_gather(lst, torch.full((2,), float(rank)))
    out["gather_list"] = [x.tolist() for x in lst] == [[float(r)] * 2 for r in range(world)]
    rs = torch.empty(2)
    comm.reduce_scatter(rs, [torch.full((2,), float(r)) for r in range(world)], op=dist.ReduceOp.SUM)
    out["reduce_scatter_list"] = rs.tolist() == [float(rank * world)] * 2
    x = torch.arange(5.0)
    y = torch.empty(5)
    comm.all_reduce(x, op="avg", output=y)
    out["out_of_place"] = x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and y.tolist() == x.tolist()
    comm.barrier()
    comm.close()
    try:
        comm.all_reduce(torch.ones(1))
        out["closed_raises"] = False
    except pycomm.CommError as e:
        out["closed_raises"] = "shut down" in str(e)
    return out


def world_of_one(rank: int, name: str) -> bool:
    comm = make_comm(0, 1, name)
    x = torch.randn(100)
    y = torch.empty(100)
    comm.all_reduce(x, output=y)
    g = torch.empty(100)
    comm.all_gather(g, x)
    r = torch.empty(100)
    comm.reduce_scatter(r, x, op="avg")
    comm.barrier()
    ok = torch.equal(x, y) and torch.equal(g, x) and torch.equal(r, x)
    comm.close()
    return ok


def default_group(rank: int, world: int, name: str) -> dict:
    """pycomm.init() bootstraps from torch.distributed's default group."""
    store = dist.PrefixStore(name, worker_store())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        comm = pycomm.init()
        t = torch.full((10,), float(rank))
        pycomm.all_reduce(t)
        g = torch.empty(world)
        pycomm.all_gather(g, torch.tensor([float(rank)]))
        pycomm.barrier()
        res = {"sum": t.tolist() == [float(sum(range(world)))] * 10, "gather": g.tolist() == [float(r) for r in range(world)],
               "same_default": pycomm.get_default() is comm, "rank": comm.rank, "world": comm.world_size}
        pycomm.destroy()
        # A second communicator on the same group gets its own key space.
        with pycomm.Communicator() as c2:
            u = torch.ones(3)
            c2.all_reduce(u)
            res["second"] = u.tolist() == [float(world)] * 3
        # A group this rank is not in: its communicator is refused at once there.
        sub = dist.new_group([0])
        if rank == 0:
            with pycomm.Communicator(sub) as c3:
                res["member"] = c3.world_size == 1
        else:
            try:
                pycomm.Communicator(sub)
                res["member"] = "built"
            except pycomm.CommError as e:
                res["member"] = "is not a member of the group [0]" in str(e)
    finally:
        dist.destroy_process_group()
    return res


def env_algorithm(rank: int, world: int, name: str) -> dict:
    os.environ["PYCOMM_ALGO"] = "tree"
    try:
        comm = make_comm(rank, world, name)
    finally:
        del os.environ["PYCOMM_ALGO"]
    res = {
        "all_reduce": comm.all_reduce(torch.ones(10), async_op=True).algorithm,
        # No tree schedule for all_gather: the preference falls back to auto.
        "all_gather": comm.all_gather(torch.empty(world), torch.ones(1), async_op=True).algorithm,
        "explicit": comm.all_reduce(torch.ones(10), algorithm="ring", async_op=True).algorithm,
    }
    comm.barrier()
    comm.close()
    return res


def coalesced(rank: int, world: int, name: str) -> dict:
    """all_reduce_coalesced: tensors of several dtypes and odd sizes, reduced
    in place with one flat all-reduce per dtype; compression only where the
    dtype takes it. Rank r's tensors hold r + 1 plus fresh random data that
    is the same on every rank (seeded), so the sum has a closed form."""
    comm = make_comm(rank, world, name)
    g = torch.Generator().manual_seed(7)
    shapes = [((3, 5), torch.float32), ((7,), torch.int64), ((1,), torch.float32), ((4, 3), torch.float16),
              ((0,), torch.float32), ((11,), torch.int32)]
    base = [torch.randint(-50, 50, s, generator=g).to(d) for s, d in shapes]
    out = {}
    for label, codec in (("plain", None), ("int8", pycomm.Int8(block=8))):
        tensors = [b + (rank + 1) for b in base]
        comm.all_reduce_coalesced(tensors, op="sum", compression=codec)
        expect = [(b.double() * world + world * (world + 1) / 2) for b in base]
        ok = True
        for t, e, (shape, dtype) in zip(tensors, expect, shapes):
            ok = ok and t.shape == shape and t.dtype == dtype
            if dtype in (torch.int32, torch.int64) or codec is None:
                ok = ok and torch.equal(t.double(), e)
            else:  # int8: half a scale per contribution and of the sum, scale <= absmax / 127
                bound = float(e.abs().amax()) / 127 * (world + 1) if e.numel() else 0.0
                ok = ok and bool(((t.double() - e).abs() <= bound + 1e-6).all())
        out[label] = ok
    comm.close()
    return out


def regrouped(rank: int, world: int, name: str) -> bool:
    """Ranks that took part in an earlier job on this process (a default
    group of the first world - 1 ranks, since destroyed) and a rank that did
    not agree on the names of the next group's communicators: the count of
    unnamed communicators starts again with each group's Store."""
    for round_, size in ((0, world - 1), (1, world)):
        if rank >= size:
            continue
        store = dist.PrefixStore(f"{name}/{round_}", worker_store())
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            with pycomm.Communicator(timeout=20) as comm:
                t = torch.ones(4)
                comm.all_reduce(t)
                assert t.tolist() == [float(size)] * 4
        finally:
            dist.destroy_process_group()
    return True


def pycomm_threads() -> list:
    """The names of this process's pycomm threads (Linux)."""
    tasks = os.listdir("/proc/self/task")
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(n for n in names if n.startswith("pycomm-"))


def reinit_on_the_same_port(rank: int, world: int, name: str) -> dict:
    """Two jobs on one port in the same processes, as a notebook or an
    elastic restart makes them: init, a communicator, close, destroy, and
    again, while the closed communicators are still referenced. A closed
    communicator holds no store (whose server would keep the first job's
    keys for the second) and no thread."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            worker_store().set(f"{name}/port", str(s.getsockname()[1]))
    port = int(worker_store().get(f"{name}/port"))
    before, kept, out = pycomm_threads(), [], {}
    for round_ in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        try:
            comm = pycomm.Communicator(timeout=20)
            out[f"running {round_}"] = sorted((Counter(pycomm_threads()) - Counter(before)).elements())
            t = torch.randn(1000, generator=torch.Generator().manual_seed(rank + 10 * round_))
            expected = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r + 10 * round_))
                           for r in range(world))
            comm.all_reduce(t)
            out[f"sum {round_}"] = bool(torch.allclose(t, expected, rtol=1e-5, atol=1e-5))
            comm.close()
            kept.append(comm)
            out[f"left {round_}"] = sorted((Counter(pycomm_threads()) - Counter(before)).elements())
        finally:
            dist.destroy_process_group()
        # Every rank past destroy before any rank starts again: one still in
        # the first job would serve the second its store, first keys and all
        # (as for any reuse of a port).
        worker_store().set(f"{name}/done{round_}/{rank}", "1")
        worker_store().wait([f"{name}/done{round_}/{r}" for r in range(world)])
    return out


def _wait_for_threads(expected: list, within_s: float = 20.0) -> list:
    """This process's pycomm threads once they are `expected` (or at the deadline)."""
    deadline = time.monotonic() + within_s
    while (now := pycomm_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


class _Inline(Exception):
    """A callback ran on the thread that attached it: its future had completed first."""


def _on_comm_thread(rank: int, world: int, name: str, attempt) -> object:
    """``attempt(sub_name, hold)`` builds a communicator and returns a future
    whose callback returns ``hold(fn)``, which waits until ``attempt``
    returned, then calls ``fn``; returns what the callback returned.

    A future that completed before ``.then()`` runs its callback at once, on
    the caller's thread: such an attempt proves nothing (and its gate would
    never open), so every rank tries again, all together, with a new
    communicator, until no rank's callback ran inline (ranks that start at
    the same moment often finish a collective that fast)."""
    store, me = worker_store(), threading.get_ident()
    for i in range(20):
        gate = threading.Event()

        def hold(value):
            if threading.get_ident() == me:
                raise _Inline()
            gate.wait(30)  # opened once attempt() returned: the closure holds the last reference
            return value()

        fut = attempt(f"{name}/{i}", hold)
        gate.set()
        result, error, inline = None, None, False
        try:
            result = fut.wait()
        except Exception as e:  # noqa: BLE001 - an inline run, or the result under test
            inline = "_Inline" in str(e)
            error = None if inline else e
        store.set(f"{name}/{i}/inline/{rank}", "1" if inline else "0")
        keys = [f"{name}/{i}/inline/{r}" for r in range(world)]
        store.wait(keys)
        if all(v == b"0" for v in store.multi_get(keys)):
            if error is not None:
                raise error
            return result
    raise AssertionError("every attempt's future completed before its callback was attached")


def last_reference_in_a_callback(rank: int, world: int, name: str) -> dict:
    """A future's callback runs on the communicator's own thread (its
    progress thread; a lane's for point-to-point). A closure there that
    held the last reference ends the communicator from another thread: the
    process does not abort (terminate: a thread cannot join itself), and the
    communicator's threads end. close() inside a callback raises."""
    before, out = pycomm_threads(), {}

    def collective(sub, hold) -> torch.futures.Future:
        comm = make_comm(rank, world, sub, timeout=30)
        t = torch.full((1000,), float(rank + 1))
        return comm.all_reduce(t, async_op=True).get_future().then(
            lambda f, c=comm: hold(lambda: f.value()[0][0].item()))

    out["collective"] = _on_comm_thread(rank, world, f"{name}/coll", collective) == world * (world + 1) / 2
    out["collective threads"] = _wait_for_threads(before) == before

    def point_to_point(sub, hold) -> torch.futures.Future:
        comm = make_comm(rank, world, sub, timeout=30)
        if rank == 0:  # the last send's future completes on its lane
            works = [comm.send(torch.full((10,), float(dst)), dst=dst, async_op=True) for dst in range(1, world)]
            return works[-1].get_future().then(lambda f, c=comm: hold(lambda: f.value() is not None))
        work = comm.recv(src=0, async_op=True)
        return work.get_future().then(lambda f, c=comm: hold(lambda: f.value()[0].tolist()))

    got = _on_comm_thread(rank, world, f"{name}/p2p", point_to_point)
    out["p2p"] = got is True if rank == 0 else got == [float(rank)] * 10
    out["p2p threads"] = _wait_for_threads(before) == before

    comms = []

    def close_in_callback(sub, hold) -> torch.futures.Future:
        comms.append(make_comm(rank, world, sub, timeout=30))
        comm = comms[-1]
        return comm.all_reduce(torch.ones(4), async_op=True).get_future().then(
            lambda f: hold(lambda: comm.close()))

    try:
        _on_comm_thread(rank, world, f"{name}/close", close_in_callback)
        out["close in a callback"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["close in a callback"] = "future's callback" in str(e)
    for comm in comms:
        comm.close()
    comms.clear()
    out["close after"] = _wait_for_threads(before) == before
    return out


def concurrent_closes(rank: int, world: int, name: str, rounds: int = 10) -> dict:
    """close() from three threads at once, with collectives still queued: the
    queue finishes with the right sums, one thread closes and the others
    wait for it (two joins of one thread never returned), nothing is left."""
    before, sums_right, raised = pycomm_threads(), True, []
    for i in range(rounds):
        comm = make_comm(rank, world, f"{name}/{i}", timeout=30)
        tensors = [torch.full((1 << 16,), float(rank + k)) for k in range(6)]
        works = [comm.all_reduce(t, async_op=True) for t in tensors]

        def close() -> None:
            try:
                comm.close()
            except Exception as e:  # noqa: BLE001 - reported
                raised.append(repr(e))

        threads = [threading.Thread(target=close) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for w in works:
            w.wait()
        sums_right &= all(bool((t == world * (world - 1) / 2 + world * k).all()) for k, t in enumerate(tensors))
    return {"sums": sums_right, "raised": raised, "threads": _wait_for_threads(before) == before}
