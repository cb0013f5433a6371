"""An ordinary torch.distributed script, with the backend string set to "pycomm".

    torchrun --nproc-per-node 3 c10d_script.py train
    python c10d_script.py host-leaves-first 3     # rank 0 hosts the store and exits first
"""
import datetime
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm  # noqa: F401  (registers the "pycomm" backend)


def train() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("pycomm", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # DDP's initial broadcast makes the models equal
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(20):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], e) for e in every), "replicas diverged"
    assert losses[-1] < losses[0], losses
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)


def one_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("pycomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    assert t[0].item() == world * (world - 1) / 2
    if rank != 0:
        time.sleep(1.0)  # rank 0, the store's host, is gone by now
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)


def host_leaves_first(world: int) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(world), str(port)])
             for r in range(world)]
    return max(p.wait(timeout=120) for p in procs)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        train()
    elif mode == "host-leaves-first":
        sys.exit(host_leaves_first(int(sys.argv[2])))
    elif mode == "rank":
        one_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {mode}")
