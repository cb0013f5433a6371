"""Tears a DDP job down right after a backward, many times over: a hook whose
future Gloo completes on its own thread must not leave that thread waiting
for the GIL while the main thread, holding it, joins it in
``~ProcessGroupGloo`` (pycomm/hooks/futures.py).

    python teardown_script.py pycomm 20   # pycomm's allreduce_hook, path="group": finishes
    python teardown_script.py torch 20    # torch's allreduce_hook: hangs in most tries

A long GIL switch interval keeps the main thread on the GIL from the end of
the backward to the teardown, which turns a rare race into a likely one.
"""
import datetime
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def rank_main(rank: int, world: int, port: int, hook: str, trials: int) -> None:
    torch.set_num_threads(1)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pycomm import hooks

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    sys.setswitchinterval(1.0)
    gen = torch.Generator().manual_seed(rank)
    for t in range(trials):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"trial{t}", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        ddp = DDP(torch.nn.Linear(64, 64))
        if hook == "pycomm":
            state = hooks.AllReduceState(path="group")
            ddp.register_comm_hook(state, hooks.allreduce_hook)
        else:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        ddp(torch.randn(8, 64, generator=gen)).sum().backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        dist.destroy_process_group()
        del ddp
        # Every rank holds the same average (the Store is the only channel left).
        assert all(torch.isfinite(g).all() for g in grads)
        store.set(f"trial{t}/grad{rank}", repr(grads[0].sum().item()))
        store.wait([f"trial{t}/grad{r}" for r in range(world)])
        sums = {store.get(f"trial{t}/grad{r}") for r in range(world)}
        assert len(sums) == 1, f"trial {t}: ranks disagree on the averaged gradient: {sums}"
    sys.stdout.write(f"rank {rank}: {trials} teardowns\n")
    sys.stdout.flush()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, free, sys.argv[1], int(sys.argv[2])), nprocs=2)
