"""Run by torchrun inside the multi-host testbed (tests/test_multihost.py):
every collective and algorithm on real separate network namespaces, checked
against closed-form results. Prints one line "testbed-check ok <details>" on
rank 0 when everything matched."""
import datetime
import os

import torch
import torch.distributed as dist

import pycomm
from pycomm.pipeline import Pipeline, StageModule


def pipeline_check(comm: "pycomm.Communicator") -> list:
    """A pipeline whose stages span the hosts (one stage per rank, or two for
    the interleaved and V schedules): loss and gradients equal one process's."""
    bad = []
    torch.set_default_dtype(torch.float64)
    try:
        for schedule in ("1f1b", "zb-h1", "interleaved-1f1b", "zbv"):
            torch.manual_seed(5)
            layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(8)]
            x, y = torch.randn(37, 16), torch.randn(37, 16)  # 37 rows into 8 uneven micro-batches
            ref = StageModule(*layers)
            loss_ref = torch.nn.functional.mse_loss(ref(x), y)
            loss_ref.backward()
            want = {id(p): p.grad.clone() for p in ref.parameters()}
            ref.zero_grad()
            pipe = Pipeline.from_layers(layers, comm, balance=[1] * 8 if schedule in ("interleaved-1f1b", "zbv")
                                        else [2] * 4, num_microbatches=8, schedule=schedule,
                                        loss_fn=torch.nn.functional.mse_loss)
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            for p in pipe.module.parameters():
                if p.grad is None or (p.grad - want[id(p)]).abs().max() > 1e-10:
                    bad.append(f"pipeline {schedule}: gradient")
                    break
            if loss is not None and abs(loss.item() - loss_ref.item()) > 1e-12:
                bad.append(f"pipeline {schedule}: loss")
    finally:
        torch.set_default_dtype(torch.float32)
    return bad


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = pycomm.Communicator(timeout=60)
    bad = []
    for n in (1, 1000, 262147):
        base = torch.arange(n, dtype=torch.float64) % 11
        for algo in ("ring", "tree", "direct", "hierarchical", "auto"):
            x = (base + rank).float()
            comm.all_reduce(x, algorithm=algo)
            if not torch.equal(x, (base * world + world * (world - 1) / 2).float()):
                bad.append(f"all_reduce n={n} {algo}")
        for algo in ("ring", "direct", "hierarchical"):
            out = torch.empty(world * n)
            comm.all_gather(out, torch.full((n,), float(rank)), algorithm=algo)
            if not torch.equal(out, torch.arange(world).float().repeat_interleave(n)):
                bad.append(f"all_gather n={n} {algo}")
            rs = torch.empty(n)
            comm.reduce_scatter(rs, torch.arange(world * n, dtype=torch.float32) % 13, algorithm=algo)
            exp = (torch.arange(world * n, dtype=torch.float32) % 13)[rank * n:(rank + 1) * n] * world
            if not torch.equal(rs, exp):
                bad.append(f"reduce_scatter n={n} {algo}")
            b = torch.full((n,), float(rank))
            comm.broadcast(b, src=world - 1, algorithm=algo)
            if not torch.equal(b, torch.full((n,), float(world - 1))):
                bad.append(f"broadcast n={n} {algo}")
    bad += pipeline_check(comm)
    # Every host looks like a host of its own to NCCL too: one NCCL_HOSTID per host.
    ids = [None] * world
    dist.all_gather_object(ids, os.environ.get("NCCL_HOSTID"))
    local = comm.local_size
    if None in ids or len(set(ids)) != world // local or any(ids[r] != ids[r - r % local] for r in range(world)):
        bad.append(f"NCCL_HOSTID per host: {ids}")
    flag = torch.tensor([len(bad)])
    dist.all_reduce(flag)
    if rank == 0:
        if flag.item() == 0:
            print(f"testbed-check ok hosts={comm.num_hosts} local_size={comm.local_size} "
                  f"transport={comm.transport}", flush=True)
        else:
            print(f"testbed-check FAILED on some rank; rank 0: {bad}", flush=True)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
