"""Worker-side cases for bounded-staleness averaging (hooks.StaleState) and
the deadline average (pycomm.DeadlineAverager); run inside harness workers
that joined hooks_cases' default group."""
from __future__ import annotations

import glob
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hooks_cases
import pycomm
from harness import worker_store
from pycomm import hooks

WIRES = {"plain": None, "bf16": torch.bfloat16, "int8": pycomm.Int8(), "int4": pycomm.Int4(),
         "topk": pycomm.TopK(0.25)}


def _gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def stale_closed_form(rank: int, world: int, staleness: int, wire: str, steps: int = 6,
                      bucket_view: bool = False, device: str = "cpu", busy_gpu: bool = False) -> Dict[str, object]:
    """Trains hooks_cases' MLP with StaleState (SGD, lr 0.1, buckets small
    enough to be several, rebuilt after the first step) and, beside it, each
    rank's own gradient at the same parameters (a copy without DDP),
    gathered and averaged in float64: the closed form. Returns per step what
    was applied and what the closed form says, and whether every rank had
    the same parameters and applied gradients. ``busy_gpu``: each backward
    starts with ~10 ms of GPU sleep on its stream, so the hooks run while
    the gradients they hand back are still to be written there (what a
    large model's backward does), which a hook must order itself after."""
    g, comm = hooks_cases._group(world)
    if rank >= world:
        return {}
    model = hooks_cases.make_model("mlp").to(device)
    twin = hooks_cases.make_model("mlp").to(device)
    ddp = DDP(model, process_group=g, bucket_cap_mb=0.02, gradient_as_bucket_view=bucket_view)
    where = dict(communicator=comm) if device == "cpu" else dict(process_group=g)
    state = hooks.StaleState(staleness=staleness, wire=WIRES[wire], **where)
    ddp.register_comm_hook(state, hooks.stale_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(300 + rank)
    refs, applied, has_update = [], [], []
    same_params = same_applied = True
    for _ in range(steps):
        x, y = (t.to(device) for t in hooks_cases.make_batch("mlp", gen))
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        mine = hooks_cases._grads(twin).double().cpu()
        refs.append(torch.stack(_gather(mine, g)).mean(0))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if busy_gpu:
            loss.register_hook(lambda grad: (torch.cuda._sleep(20_000_000), grad)[1])
        loss.backward()
        got = hooks_cases._grads(model).cpu()
        same_applied &= all(torch.equal(got, o) for o in _gather(got, g))
        applied.append(got.double())
        has_update.append(state.has_update)
        opt.step()
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        same_params &= all(torch.equal(w, o) for o in _gather(w, g))
    for _ in state.flush():
        got = hooks_cases._grads(model).cpu()
        same_applied &= all(torch.equal(got, o) for o in _gather(got, g))
        applied.append(got.double())
        opt.step()
    return {"refs": refs, "applied": applied, "has_update": has_update, "same_params": same_params,
            "same_applied": same_applied, "in_flight": state.in_flight, "stats": state.stats(),
            "routes": state.routes()}


def stale_state_dict(rank: int, world: int) -> Dict[str, object]:
    """state_dict refuses while averages travel, works after flush, and a
    fresh state loaded from it carries the iteration count and residuals."""
    g, comm = hooks_cases._group(world)
    if rank >= world:
        return {}
    model = hooks_cases.make_model("mlp")
    ddp = DDP(model, process_group=g)
    state = hooks.StaleState(staleness=1, wire=pycomm.Int8(), communicator=comm)
    ddp.register_comm_hook(state, hooks.stale_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = hooks_cases.make_batch("mlp", gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    out: Dict[str, object] = {}
    try:
        state.state_dict()
    except RuntimeError as e:
        out["refused"] = str(e)
    flushed = list(state.flush())
    sd = state.state_dict()
    fresh = hooks.StaleState(staleness=1, wire=pycomm.Int8(), communicator=comm)
    fresh.load_state_dict(sd)
    out.update(flushed=flushed, iteration=fresh.iteration,
               residuals=sum(1 for t in sd["inner"]["worker_residuals"] if t is not None))
    return out


# ---------------------------------------------------------------- deadline

_NUMEL = 37  # odd: shards of unequal length


def _grad_value(rank: int, call: int) -> torch.Tensor:
    """Gradient of rank's call-th contribution: small integers (exact sums)."""
    gen = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randint(-50, 50, (_NUMEL,), generator=gen).double()


def deadline_case(rank: int, world: int, steps: int, slow, late_s: float, deadline: Optional[float],
                  backups: Optional[int] = None, seed: int = 0, ring: Optional[int] = None,
                  compute_s: float = 0.0) -> Dict[str, object]:
    """A float64 parameter trained with SGD (lr 1) on known gradients;
    every rank "computes" (sleeps) ``compute_s`` per call, and ``slow`` (a
    rank, or "random") sleeps ``late_s`` more before each of its
    contributions. Returns what every rank contributed, the contributors and
    parameters of each global step, and how long each step() waited."""
    if rank >= world:
        return {}
    param = torch.nn.Parameter(torch.zeros(_NUMEL, dtype=torch.float64))
    params: List[torch.Tensor] = []

    class Recorder:  # stepped after every global step applied: the parameter then
        def step(self):
            params.append(param.detach().clone())

    opt = pycomm.DeadlineAverager(torch.optim.SGD([param], lr=1.0), deadline=deadline, backups=backups,
                                  lr_scheduler=Recorder(),
                                  total_steps=steps, store=worker_store(), rank=rank, world_size=world,
                                  name=f"deadline/{world}/{slow}/{deadline}/{backups}/{seed}/{ring}", timeout=60,
                                  ring=ring or steps)
    leaked = glob.glob("/dev/shm/pycomm.deadline.*")
    straggler = pycomm.Straggler(slow, delay=late_s, seed=seed)
    sent, waits = [], []
    call = 0
    while opt.step_count < steps:
        with straggler.step(call, rank, world):
            time.sleep(compute_s)
            param.grad = _grad_value(rank, call)
        sent.append(param.grad.clone())
        t = time.perf_counter()
        opt.step()
        waits.append((time.perf_counter() - t, straggler.slow_rank(call, world) == rank))
        call += 1
    s = opt.stats()
    return {"sent": sent, "waits": waits, "final": param.detach().clone(), "stats": s, "leaked": leaked,
            "params_at_steps": params}


def deadline_errors(rank: int, world: int) -> Dict[str, str]:
    """Bad arguments and a job spanning (simulated) hosts."""
    if rank >= world:
        return {}
    p = torch.nn.Parameter(torch.zeros(4))
    out = {}
    for what, kw in {"neither": dict(deadline=None, backups=None), "backups": dict(backups=world),
                     "negative": dict(deadline=-1.0)}.items():
        try:
            pycomm.DeadlineAverager(torch.optim.SGD([p], lr=1.0), store=worker_store(), rank=rank,
                                    world_size=world, name=f"bad/{what}", **kw)
        except ValueError as e:
            out[what] = str(e)
    try:
        pycomm.DeadlineAverager(torch.optim.SGD([p], lr=1.0), store=worker_store(), rank=rank, world_size=world,
                                name="hosts", local_size=world // 2, timeout=30)
    except pycomm.CommError as e:
        out["hosts"] = str(e)
    return out


def digits_deadline(rank: int, world: int, steps: int, slow: int, late_s: float, deadline: float,
                    lr: float = 0.1) -> float:
    """hooks_cases' digits recipe (global batch 64, SGD momentum, cosine to
    zero) with DeadlineAverager for ``steps`` global steps, one rank late by
    ``late_s`` every call; the model unwrapped (no DDP), each rank seeded
    differently: the averager starts them from rank 0's parameters."""
    if rank >= world:
        return 0.0
    xtr, ytr, xte, yte = hooks_cases._digits()
    torch.manual_seed(rank)
    model = hooks_cases.digits_mlp()
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(base, steps)
    opt = pycomm.DeadlineAverager(base, deadline=deadline, total_steps=steps, lr_scheduler=sched,
                                  store=worker_store(), rank=rank, world_size=world, name=f"digits/{slow}/{steps}",
                                  timeout=60)
    straggler = pycomm.Straggler(slow, delay=late_s)
    gen = torch.Generator().manual_seed(7 + rank)
    per_rank = 64 // world
    call = 0
    while opt.step_count < steps:
        with straggler.step(call, rank, world):
            idx = torch.randint(0, len(xtr), (per_rank,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        call += 1
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item() * 100
