"""Worker-side case: a step whose gradients overflow on one rank, as the
scaled loss of mixed-precision training does now and then (GradScaler then
skips the step and lowers its scale). Run inside the hooks suites' workers,
on their groups and communicators."""
from __future__ import annotations

from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from hooks_cases import HOOKS, _group, _state, make_batch, make_model
from pycomm import hooks

#: Hooks whose state is in play; powersgd-int8: its factors as int8 codes.
OVERFLOW_HOOKS = ("allreduce", "bf16", "int8", "int4", "topk", "powersgd", "powersgd-int8", "stale")
OVERFLOW_STEP = 4


def _hook_state(hook: str, comm, group, device: str):
    where = dict(communicator=comm) if device == "cpu" else dict(process_group=group, path="group")
    if hook == "powersgd-int8":
        return hooks.PowerSGDState(rank=2, start_iter=2, wire=pycomm.Int8(), **where), hooks.powersgd_hook
    if hook == "stale":
        return hooks.StaleState(**where), hooks.stale_hook
    if hook == "topk":  # top-k 10 %: most of an overflowing bucket stays unsent
        return hooks.CompressionState(codec=pycomm.TopK(0.1), start_iter=0, **where), hooks.topk_hook
    return _state(hook, comm, "auto" if device == "cpu" else "group", group, device), HOOKS[hook]


def overflow_step(rank: int, world: int, hook: str, steps: int = 9, device: str = "cpu") -> Dict[str, object]:
    """SGD on the MLP, skipping a step whose averaged gradients are not all
    finite (GradScaler's rule); at OVERFLOW_STEP rank 0's loss is multiplied
    by Inf, which leaves Inf and NaN throughout its gradients. Returns which
    steps' gradients were finite and the final parameters."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    model = make_model("mlp").to(device)
    ddp = DDP(model, process_group=g, bucket_cap_mb=0.002)
    state, hook_fn = _hook_state(hook, comm, g, device)
    ddp.register_comm_hook(state, hook_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5000 + rank)
    finite = []
    for step in range(steps):
        x, y = (t.to(device) for t in make_batch("mlp", gen))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if step == OVERFLOW_STEP and rank == 0:
            loss = loss * float("inf")
        loss.backward()
        ok = all(bool(p.grad.isfinite().all()) for p in model.parameters())
        finite.append(ok)
        if ok:
            opt.step()
    return {"finite": finite, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()}
