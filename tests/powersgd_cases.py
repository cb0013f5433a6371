"""Worker-side cases for the PowerSGD hook (tests/test_powersgd.py): against
torch's powerSGD_hook on the same buckets, against a float64 reference of
the algorithm, and through a checkpoint."""
from __future__ import annotations

import io
from typing import Dict, List

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from hooks_cases import _grads, _group, init_default, make_batch, make_model, train_step  # noqa: F401 (init_default: the pool's set-up)
from pycomm import hooks


def _backward_each(models, x: torch.Tensor, y: torch.Tensor) -> None:
    """Fresh gradients of each model on the same batch."""
    for m in models:
        for p in m.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(m(x), y).backward()


def torch_parity(rank: int, world: int, matrix_rank: int, batch: bool, path: str = "auto",
                 steps: int = 6, dtype: torch.dtype = torch.float32) -> Dict[str, object]:
    """DDP with torch's powerSGD_hook and DDP with pycomm's, same parameters,
    same data, same settings (no optimizer step, so every step's buckets are
    comparable): the largest difference of the averaged gradients, relative
    to their scale, per step."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    # One bucket: torch's hook waits for P's all-reduce inside a callback on
    # one of Gloo's two threads, so with several buckets in flight both
    # threads wait for all-reduces only they could run (it hangs; seen here).
    kw = dict(process_group=g, bucket_cap_mb=25)
    theirs, ours = DDP(make_model("mlp").to(dtype), **kw), DDP(make_model("mlp").to(dtype), **kw)
    settings = dict(matrix_approximation_rank=matrix_rank, start_powerSGD_iter=2, random_seed=0,
                    batch_tensors_with_same_shape=batch)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(process_group=g, **settings), torch_powersgd.powerSGD_hook)
    where = dict(communicator=comm) if path == "auto" else dict(process_group=g, path=path)
    # pycomm's state from the same keywords, torch's names.
    state = hooks.PowerSGDState(**settings, **where)
    ours.register_comm_hook(state, hooks.powersgd_hook)
    gen = torch.Generator().manual_seed(4000 + rank)
    rel: List[float] = []
    for _ in range(steps):
        _backward_each((theirs, ours), *(t.to(dtype) for t in make_batch("mlp", gen)))
        a, b = _grads(theirs.module).float(), _grads(ours.module).float()
        rel.append(((a - b).abs().max() / a.abs().max()).item())
    return {"rel": rel, "ratio": state.compression_stats()[0], "routes": state.routes(), "grads": _grads(ours.module)}


def _mgs(m: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt of the columns, float64."""
    m = m.clone()
    for i in range(m.shape[1]):
        m[:, i] /= m[:, i].norm()
        m[:, i + 1:] -= (m[:, i:i + 1] * m[:, i + 1:]).sum(0, keepdim=True) * m[:, i:i + 1]
    return m


def reference(rank: int, world: int, matrix_rank: int, steps: int = 5) -> Dict[str, float]:
    """One Linear(48, 40) under pycomm's hook (one bucket, no optimizer step)
    against the algorithm in float64, computed by every rank from every
    rank's gradients (each rank can draw any rank's data): the largest
    difference relative to the gradients' scale, over the compressed steps."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    def model():
        torch.manual_seed(5)
        return torch.nn.Linear(48, 40)

    ddp = DDP(model(), process_group=g)
    ddp.register_comm_hook(hooks.PowerSGDState(rank=matrix_rank, start_iter=2, communicator=comm),
                           hooks.powersgd_hook)
    local = model()
    gens = [torch.Generator().manual_seed(6000 + r) for r in range(world)]
    errors = [None] * world
    q = None
    seeds = np.random.RandomState(0)  # the state's stream of seeds (seed=0)
    worst = 0.0
    for step in range(steps):
        batches = [(torch.randn(16, 48, generator=gen), torch.randn(16, 40, generator=gen)) for gen in gens]
        grads = []
        for x, y in batches:
            local.zero_grad()
            torch.nn.functional.mse_loss(local(x), y).backward()
            grads.append((local.weight.grad.double().clone(), local.bias.grad.double().clone()))
        for p in ddp.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(ddp(batches[rank][0]), batches[rank][1]).backward()
        if step < 2:  # plain averages first
            want_w = sum(w for w, _ in grads) / world
            want_b = sum(b for _, b in grads) / world
        else:
            if errors[0] is None:
                errors = [(torch.zeros_like(w), torch.zeros_like(b)) for w, b in grads]
            ms = [w + e[0] for (w, _), e in zip(grads, errors)]
            bs = [b + e[1] for (_, b), e in zip(grads, errors)]
            if q is None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seeds.randint(1_000_000_000))
                    q = torch.randn(1, 48, matrix_rank).double()[0]
            q = _mgs(q)
            p = _mgs(sum(m @ q for m in ms))
            q = sum(m.T @ p for m in ms) / world
            want_w = p @ q.T
            want_b = sum(bs) / world
            errors = [(m - want_w, b - want_b) for m, b in zip(ms, bs)]
            scale = want_w.abs().max().item()
            worst = max(worst, (ddp.module.weight.grad.double() - want_w).abs().max().item() / scale,
                        (ddp.module.bias.grad.double() - want_b).abs().max().item() / scale)
        if step < 2:
            assert torch.allclose(ddp.module.weight.grad.double(), want_w, atol=1e-6)
    return {"worst": worst}


def checkpoint(rank: int, world: int, wire: str, via: str = "state_dict") -> Dict[str, object]:
    """Train 6 steps (PowerSGD from step 2); at step 4 save model, optimizer
    and hook state through torch.save, resume a fresh DDP and state from it,
    and run steps 5-6 on both: the same parameters, bit for bit (one bucket:
    DDP's layout does not change). A resume without the hook's state differs.
    ``via``: the checkpoint holds ``state.state_dict()``, or the state
    itself ("pickle", as torch's PowerSGDState allows), which unpickled
    serves the default group until its ``process_group`` is set."""
    import pycomm

    g, comm = _group(world)
    if rank >= world:
        return {}

    def fresh(st=None):
        m = DDP(make_model("mlp"), process_group=g)
        st = st or hooks.PowerSGDState(rank=2, start_iter=2, communicator=comm,
                                       # nearest rounding: stochastic draws follow the communicator's call count
                                       wire=pycomm.Int8(stochastic=False) if wire == "int8" else None)
        m.register_comm_hook(st, hooks.powersgd_hook)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), st

    gen = torch.Generator().manual_seed(7000 + rank)
    batches = [make_batch("mlp", gen) for _ in range(6)]
    m, opt, st = fresh()
    for b in batches[:4]:
        train_step(m, opt, b)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "hook": st if via == "pickle" else st.state_dict()},
               buf)
    for b in batches[4:]:
        train_step(m, opt, b)
    results = {}
    for name, keep_hook in (("with", True), ("without", False)):
        ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        if via == "pickle" and keep_hook:
            st2 = ckpt["hook"]
            results["unpickled"] = (type(st2).__name__, st2.rank, st2.start_iter, repr(st2.wire), st2.iteration)
            st2.process_group = g  # the pool's default group is larger
            m2, opt2, st2 = fresh(st2)
        else:
            m2, opt2, st2 = fresh()
            saved = ckpt["hook"].state_dict() if via == "pickle" else ckpt["hook"]
            st2.load_state_dict(saved if keep_hook else {"iteration": saved["iteration"]})
        m2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        for b in batches[4:]:
            train_step(m2, opt2, b)
        results[name] = all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
        results[name + "_diff"] = max((a - b).abs().max().item() for a, b in zip(m.parameters(), m2.parameters()))
        if st2._communicator is not None and st2._communicator is not comm:
            st2._communicator.close()
    results["iteration"] = st.iteration
    return results


def stale_equals_delayed(rank: int, world: int, steps: int = 6) -> Dict[str, object]:
    """StaleState(staleness=1, wire=PowerSGD(4)) and powersgd_hook side by
    side on the same data and parameters (no optimizer step): what the stale
    hook hands DDP at step t is, bit for bit, what the direct hook handed it
    at step t - 1 (zeros at step 0)."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    direct, stale = DDP(make_model("mlp"), process_group=g), DDP(make_model("mlp"), process_group=g)
    direct.register_comm_hook(hooks.PowerSGDState(rank=4, start_iter=2, communicator=comm), hooks.powersgd_hook)
    state = hooks.StaleState(staleness=1, wire=hooks.PowerSGD(4), communicator=comm)
    stale.register_comm_hook(state, hooks.stale_hook)
    gen = torch.Generator().manual_seed(8000 + rank)
    got, want = [], []
    for _ in range(steps):
        _backward_each((direct, stale), *make_batch("mlp", gen))
        want.append(_grads(direct.module))
        got.append(_grads(stale.module))
    same = [torch.equal(got[t], want[t - 1]) for t in range(1, steps)]
    return {"same": same, "first_zero": bool((got[0] == 0).all()), "routes": state.routes()}
