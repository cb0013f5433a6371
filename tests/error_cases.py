"""Worker-side error scenarios (run inside harness workers)."""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional

import torch

import pycomm
from harness import all_reached, make_comm


def _outcome(fn) -> Optional[str]:
    """None if fn() succeeded, else 'CommError: <message>' / '<Type>: ...'."""
    try:
        fn()
        return None
    except pycomm.CommError as e:
        return f"CommError: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test as text
        return f"{type(e).__name__}: {e}"


def _wrapper(n: int) -> torch.Tensor:
    """A tensor subclass that wraps others and has no storage of its own."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.ones(n), torch.ones(n))


def bad_inputs(rank: int, world: int, name: str) -> List[tuple]:
    """Every rank makes the same mistake; each must raise CommError and leave
    the communicator usable (checked by a correct all_reduce after each)."""
    comm = make_comm(rank, world, name, timeout=20)
    n = 33
    good = torch.ones(n)
    cases = {
        "non-contiguous": lambda: comm.all_reduce(torch.ones(n, 2).t()),
        "int16 sum": lambda: comm.all_reduce(torch.ones(n, dtype=torch.int16)),
        "complex": lambda: comm.all_reduce(torch.ones(n, dtype=torch.complex64)),
        "band on float": lambda: comm.all_reduce(good.clone(), op="band"),
        "meta device": lambda: comm.all_reduce(torch.empty(n, device="meta")),
        "output size": lambda: comm.all_reduce(good.clone(), output=torch.empty(n + 1)),
        "output dtype": lambda: comm.all_reduce(good.clone(), output=torch.empty(n, dtype=torch.float64)),
        "partial overlap": lambda: (lambda b: comm.all_reduce(b[:n], output=b[1:n + 1]))(torch.ones(2 * n)),
        "avg on int": lambda: comm.all_reduce(torch.ones(n, dtype=torch.int32), op="avg"),
        "unknown op": lambda: comm.all_reduce(good.clone(), op="prod"),
        "unknown algorithm": lambda: comm.all_reduce(good.clone(), algorithm="butterfly"),
        "tree for all_gather": lambda: comm.all_gather(torch.empty(n * world), good, algorithm="tree"),
        "reduce_scatter sizes": lambda: comm.reduce_scatter(torch.empty(n), torch.ones(n * world + 1)),
        # In place is this rank's block of the input only (NCCL's form).
        "reduce_scatter overlap": lambda: (lambda b: comm.reduce_scatter(b[rank * n + 1:(rank + 1) * n + 1],
                                                                         b[:n * world]))(torch.ones(n * world + 1)),
        "all_gather sizes": lambda: comm.all_gather(torch.empty(n * world - 1), good),
        "broadcast src": lambda: comm.broadcast(good.clone(), src=world),
        "async list all_gather": lambda: comm.all_gather([torch.empty(n)] * world, good, async_op=True),
        # A wrapper subclass (as DTensor is) has no storage: this crashed the process.
        "wrapper subclass": lambda: comm.all_reduce(_wrapper(n)),
        "wrapper subclass, compressed": lambda: comm.all_reduce(_wrapper(n), compression=pycomm.Int8()),
        "wrapper subclass output": lambda: comm.all_gather(_wrapper(n * world), good),
        # Lazy views whose memory holds other values than they read as.
        "negative view": lambda: comm.all_reduce(torch._neg_view(torch.ones(n)), op="max"),
        "nested": lambda: comm.all_reduce(torch.nested.nested_tensor([torch.ones(3), torch.ones(n - 3)])),
    }
    out = []
    for label, fn in cases.items():
        err = _outcome(fn)
        x = torch.full((n,), float(rank + 1))
        comm.all_reduce(x)
        usable = bool((x == world * (world + 1) / 2).all())
        out.append((label, err, usable))
    comm.close()
    return out


def mismatch(rank: int, world: int, name: str, kind: str, odd_rank: int = 1,
             **comm_kwargs) -> List[Optional[str]]:
    """Rank `odd_rank` disagrees with the others in `kind`; returns the outcome
    of that call and of one more call afterwards."""
    comm = make_comm(rank, world, name, timeout=20, **comm_kwargs)
    odd = rank == odd_rank
    x = torch.randn(1000)
    calls = {
        "count": lambda: comm.all_reduce(torch.randn(999 if odd else 1000)),
        "dtype": lambda: comm.all_reduce(x.double() if odd else x),
        "op": lambda: comm.all_reduce(x, op="max" if odd else "sum"),
        "collective": lambda: comm.broadcast(x) if odd else comm.all_reduce(x),
        "algorithm": lambda: comm.all_reduce(x, algorithm="tree" if odd else "ring"),
        "root": lambda: comm.broadcast(x, src=1 if odd else 0),
        "invalid on one rank": lambda: comm.all_reduce(torch.ones(10, 2).t() if odd else torch.ones(2, 10)),
        "barrier vs all_reduce": lambda: comm.barrier() if odd else comm.all_reduce(x),
    }
    first = _outcome(calls[kind])
    after = _outcome(lambda: comm.all_reduce(torch.ones(4)))
    comm.close()
    return [first, after]


def sparse_on_one_rank(rank: int, world: int, name: str, layout: str, compressed: bool) -> List[tuple]:
    """Rank 1 passes a sparse tensor where the others pass a dense one: its
    call must still take its turn, so that every rank raises at once rather
    than its peers waiting for the timeout (a CSR tensor's is_contiguous()
    throws, which once happened before the call took its turn), and say
    why (a COO tensor is "not contiguous" only in a misleading sense)."""
    comm = make_comm(rank, world, name, timeout=20)
    dense = torch.randn(8, 8)
    x = (dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()) if rank == 1 else dense
    kwargs = {"compression": pycomm.Int8(), "op": "avg"} if compressed else {}
    t0 = time.monotonic()
    err = _outcome(lambda: comm.all_reduce(x, **kwargs))
    elapsed = time.monotonic() - t0
    comm.close()
    return [err, elapsed]


def late_peer(rank: int, world: int, name: str, timeout: float, **comm_kwargs) -> tuple:
    """Rank 1 arrives long after the timeout: rank 0 must give up in time."""
    comm = make_comm(rank, world, name, timeout=timeout, **comm_kwargs)
    comm.all_reduce(torch.ones(8))
    if rank == 1:
        time.sleep(timeout + 1.5)
    t0 = time.monotonic()
    err = _outcome(lambda: comm.all_reduce(torch.ones(8)))
    elapsed = time.monotonic() - t0
    comm.close()
    return err, elapsed


def abort_between_hosts(rank: int, world: int, name: str, aborter: int, receiver: int, **comm_kwargs) -> dict:
    """Rank `aborter` sends `receiver` (on another host) a message, then
    aborts while every other rank waits in an all-reduce (timeout 30 s).
    Returns each rank's outcome of that all-reduce and of a later one, how
    long each took, the message as received after the abort, and the close's
    time."""
    comm = make_comm(rank, world, name, timeout=30, **comm_kwargs)
    comm.all_reduce(torch.ones(8))
    x = torch.randn(6, generator=torch.Generator().manual_seed(world))  # the same on every rank
    out: dict = {}
    if rank == aborter:
        comm.send(x, receiver)
        all_reached(rank, world, f"{name}/waiting")
        time.sleep(0.2)  # the others are inside their all-reduce
        comm.abort("rank %d's step raised" % rank, name_rank=False)
    else:
        work = comm.all_reduce(torch.ones(1 << 12), async_op=True)
        all_reached(rank, world, f"{name}/waiting")
        t0 = time.monotonic()
        out["current"] = _outcome(work.wait)
        out["current_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        out["later"] = _outcome(lambda: comm.all_reduce(torch.ones(8)))
        out["later_s"] = time.monotonic() - t0
        if rank == receiver:  # sent before the abort: still delivered
            out["message"] = float((comm.recv(aborter) - x).abs().max())
    all_reached(rank, world, f"{name}/done")
    t0 = time.monotonic()
    comm.close()
    out["close_s"] = time.monotonic() - t0
    return out


def stream_until_killed(rank: int, world: int, name: str, victim: int, after: int, timeout: float,
                        **comm_kwargs) -> tuple:
    """A stream of collectives of mixed sizes; rank `victim` SIGKILLs itself
    after `after` of them. Survivors report their error and how long they
    took to notice."""
    comm = make_comm(rank, world, name, timeout=timeout, **comm_kwargs)
    sizes = [1, 1000, 100_000, 7, 300_000]
    last_ok = time.monotonic()
    for i in range(10_000):
        if rank == victim and i == after:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(sizes[i % len(sizes)])
        try:
            comm.all_reduce(x, algorithm=["ring", "tree", "direct"][i % 3])
        except pycomm.CommError as e:
            return str(e), time.monotonic() - last_ok, i
        last_ok = time.monotonic()
    return None, 0.0, -1




def missing_rank(rank: int, world: int, name: str, timeout: float) -> Optional[str]:
    """The last rank never creates its communicator."""
    if rank == world - 1:
        return None
    return _outcome(lambda: make_comm(rank, world, name, timeout=timeout))


def other_build(rank: int, world: int, name: str) -> Optional[str]:
    """The last rank runs another build of pycomm (its version string)."""
    from pycomm import bootstrap

    real = bootstrap._build
    if rank == world - 1:
        bootstrap._build = lambda: real().replace("pycomm ", "pycomm 9.9-")
    try:
        return _outcome(lambda: make_comm(rank, world, name, timeout=30).close())
    finally:
        bootstrap._build = real  # the pool's process serves the next tests
