"""A helper process made by fork() while a job runs on pycomm, as code that
writes a checkpoint in a child does. The child must neither hang nor touch
the parent's job: its collective calls raise CommError saying why, and it
exits normally (the interpreter's exit, atexit handlers and the release of
every pycomm object it inherited). The parents then go on with their job.

    python fork_script.py    # one JSON line per rank: what the child saw, what the parent saw after

Both ranks fork: rank 0 also holds the store's server. Each child reports
through a pipe; a child that has not exited within CHILD_DEADLINE_S is
killed and reported as hung.
"""
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHILD_DEADLINE_S = 30.0


def _try(fn) -> str:
    """What a call in the child did: "ok", or the exception's type and text."""
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported, and the test checks it
        return f"{type(e).__name__}: {e}"


def child(comm, group, registered, pending, fd: int) -> None:
    """Runs in the forked child; exits through the interpreter's normal exit."""
    import pycomm

    peer = 1 - dist.get_rank()
    seen = {
        "communicator": _try(lambda: comm.all_reduce(torch.ones(8))),
        "registered": _try(lambda: comm.all_reduce(registered)),
        "default": _try(lambda: pycomm.all_reduce(torch.ones(8))),
        "backend": _try(lambda: dist.all_reduce(torch.ones(8))),
        "backend send": _try(lambda: dist.send(torch.ones(8), peer)),
        "group": _try(lambda: group.all_reduce(torch.ones(8), compression=pycomm.Int8())),
        "pending": _try(pending.wait) if pending is not None else "none",
        "close": _try(comm.close),
        "destroy": _try(dist.destroy_process_group),
    }
    os.write(fd, json.dumps(seen).encode())
    os.close(fd)
    sys.exit(0)  # the interpreter's exit: atexit handlers, then every object released


def rank_main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    import pycomm

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("cpu:pycomm", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    comm = pycomm.Communicator()
    pycomm.init()
    group = pycomm.GroupCommunicator(backend="gloo")  # a lane: a private Gloo group and a thread
    group.all_reduce(torch.ones(8), compression=pycomm.Int8())
    registered = comm.empty(1000, dtype=torch.float32)
    registered.fill_(rank + 1)
    comm.all_reduce(registered)
    dist.barrier()

    # Rank 0's all-reduce is in progress at the fork: rank 1 joins it only
    # once rank 0's child has finished.
    pending = comm.all_reduce(torch.full((8,), 1.0 + rank), async_op=True) if rank == 0 else None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        child(comm, group, registered, pending, write)  # ends with sys.exit(0), through multiprocessing's own exit
    os.close(write)
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    hung = not done
    if hung:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    report = os.read(read, 1 << 16).decode()
    os.close(read)
    out = {"rank": rank, "child_hung": hung, "child_exit": None if hung else os.waitstatus_to_exitcode(status),
           "child": json.loads(report) if report else None}

    if rank == 0:
        store.set("child 0 done", "1")
        pending.wait()
        out["pending"] = pending.result()[0].tolist() == [3.0] * 8
    else:
        store.wait(["child 0 done"])
        mine = torch.full((8,), 2.0)
        comm.all_reduce(mine)
        out["pending"] = mine.tolist() == [3.0] * 8

    # The parent's job goes on: every path, fresh data each round.
    right = 0
    for i in range(20):
        gen = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(4096, generator=gen)
        want = sum(torch.randn(4096, generator=torch.Generator().manual_seed(100 * i + r)).double()
                   for r in range(world))
        a, b, c, g = x.clone(), x.clone(), x.clone(), x.clone()
        comm.all_reduce(a)
        pycomm.all_reduce(b)
        dist.all_reduce(c)
        group.all_reduce(g, compression=pycomm.Int8())  # int8 codes: within a few steps of 1/127 of the largest
        registered.copy_(x[:1000])
        comm.all_reduce(registered)
        box = torch.empty(64)
        if rank == 0:
            dist.send(x[:64].contiguous(), 1)
            dist.recv(box, 1)
        else:
            dist.recv(box, 0)
            dist.send(x[:64].contiguous(), 0)
        other = torch.randn(4096, generator=torch.Generator().manual_seed(100 * i + (1 - rank)))
        right += all(torch.allclose(t.double(), want, rtol=1e-5, atol=1e-5) for t in (a, b, c)) and \
            torch.allclose(registered.double(), want[:1000], rtol=1e-5, atol=1e-5) and torch.equal(box, other[:64]) and \
            bool((g.double() - want).abs().max() <= 0.05 * want.abs().max())
    out["parent_rounds_right"] = right
    comm.close()
    pycomm.destroy()
    dist.destroy_process_group()
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, free), nprocs=2)
