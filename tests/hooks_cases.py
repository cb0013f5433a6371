"""Worker-side cases for the DDP comm hooks (run inside harness workers).
Every worker joins one default Gloo group; DDP runs on subgroups of it, and
each subgroup has one pycomm communicator, built once per worker."""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from harness import join_default_group
from pycomm import hooks

_GROUPS: Dict[int, Tuple[object, Optional[pycomm.Communicator]]] = {}


def init_default(rank: int, world: int, name: str) -> str:
    join_default_group(rank, world, name)
    # Subgroups (every pool rank takes part in creating each one) and their
    # communicators, up front: torch names groups by creation order.
    for w in (2, 4):
        g = dist.new_group(list(range(w)))
        comm = pycomm.Communicator(g, timeout=60) if rank < w else None
        _GROUPS[w] = (g, comm)
    return dist.get_backend()


def _group(world: int):
    return _GROUPS[world]


# ---------------------------------------------------------------- models


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
                                   torch.nn.Linear(96, 8))
    if name == "cnn":
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 8))
    if name == "linear":  # one parameter: one bucket, before and after DDP rebuilds its buckets
        return torch.nn.Linear(32, 8, bias=False)
    if name == "mixed":  # embedding, norm, bias-free layer
        return torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.LayerNorm(24), torch.nn.Flatten(),
                                   torch.nn.Linear(24 * 4, 40, bias=False), torch.nn.GELU(), torch.nn.Linear(40, 8))
    raise ValueError(name)


def make_batch(name: str, gen: torch.Generator, batch: int = 8):
    if name == "cnn":
        x = torch.randn(batch, 3, 8, 8, generator=gen)
    elif name == "mixed":
        x = torch.randint(0, 50, (batch, 4), generator=gen)
    else:
        x = torch.randn(batch, 32, generator=gen)
    return x, torch.randn(batch, 8, generator=gen)


def _state(hook: str, comm, path: str = "auto", group=None, device: str = "cpu", **kw):
    """A hook's state over ``comm`` (CPU, path "auto"), or over the DDP
    process group ``group`` (CUDA buckets, or another path forced)."""
    where = (dict(communicator=comm) if path == "auto" and device == "cpu"
             else dict(process_group=group, path=path))
    if hook in ("allreduce", "bf16", "allreduce_reg"):
        return hooks.AllReduceState(wire_dtype=torch.bfloat16 if hook == "bf16" else None,
                                    registered=hook == "allreduce_reg", **where)
    if hook == "local_sgd":
        return hooks.LocalSGDState(**where, **kw)
    if hook == "powersgd":
        return hooks.PowerSGDState(rank=2, start_iter=kw.get("start_iter", 2), **where)
    codec = kw.get("codec") or {"int8": pycomm.Int8(), "int4": pycomm.Int4(), "topk": pycomm.TopK(0.25)}[hook]
    return hooks.CompressionState(codec=codec, start_iter=kw.get("start_iter", 0),
                                  error_feedback=kw.get("error_feedback", True), **where)


HOOKS = {"allreduce": hooks.allreduce_hook, "bf16": hooks.allreduce_hook, "allreduce_reg": hooks.allreduce_hook, "int8": hooks.int8_hook,
         "int4": hooks.int4_hook, "topk": hooks.topk_hook, "local_sgd": hooks.local_sgd_hook,
         "powersgd": hooks.powersgd_hook}


def _counting(hook, seen: list):
    """``hook`` that also records (iteration, bucket index) of each call."""
    def spy(state, bucket):
        seen.append((state.iteration, bucket.index()))
        return hook(state, bucket)
    return spy


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    """One step of mean squared error on ``batch`` (x, y)."""
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(batch[0]), batch[1]).backward()
    opt.step()


def _grads(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flat (zeros for one this iteration left unused)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------- cases


def grads_match(rank: int, world: int, model_name: str, bucket_mb: float, steps: int = 3,
                registered: bool = False) -> Dict[str, float]:
    """DDP without a hook and DDP with allreduce_hook (optionally with
    registered bucket copies), side by side on the same data: gradients of
    every step and the final parameters."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    ref = DDP(make_model(model_name), process_group=g, bucket_cap_mb=bucket_mb)
    ours = DDP(make_model(model_name), process_group=g, bucket_cap_mb=bucket_mb)
    seen: list = []
    ours.register_comm_hook(hooks.AllReduceState(communicator=comm, registered=registered),
                            _counting(hooks.allreduce_hook, seen))
    in_place = comm.in_place_calls
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(1000 + rank)
    worst = 0.0
    for _ in range(steps):
        x, y = make_batch(model_name, gen)
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        worst = max(worst, (_grads(ref.module) - _grads(ours.module)).abs().max().item())
        for opt in opts:
            opt.step()
    pdiff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    return {"grad_diff": worst, "param_diff": pdiff, "grad_scale": _grads(ref.module).abs().max().item(),
            "buckets": len({i for _, i in seen}), "in_place": comm.in_place_calls - in_place}


class _WithSideBranch(torch.nn.Module):
    """The MLP plus a side branch that only some iterations use (what DDP's
    find_unused_parameters is for: the branch's gradients are zeros in its
    bucket on the others)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model("mlp")
        self.side = torch.nn.Linear(32, 8)
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.side(x) if self.use_side else self.body(x)


def compose(rank: int, world: int, hook: str, option: str, iters: int = 3, path: str = "auto",
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> Dict[str, object]:
    """A hook under one DDP option (gradient_as_bucket_view, static_graph,
    no_sync accumulation, or find_unused_parameters with a branch used every
    other iteration), against DDP without a hook on the same data and
    parameters (no optimizer step: every iteration's gradients are comparable).
    Returns the relative error of the summed gradients (error feedback makes
    the sum, not each step, close) and this rank's gradients."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    kw = dict(process_group=g, bucket_cap_mb=0.002)
    if option == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    if option == "static_graph":
        kw["static_graph"] = True
    if option == "find_unused":
        kw["find_unused_parameters"] = True
    build = _WithSideBranch if option == "find_unused" else (lambda: make_model("mlp"))
    ref = DDP(build().to(device, dtype), **kw)
    ours = DDP(build().to(device, dtype), **kw)
    state = _state(hook, comm, path, g, device)
    ours.register_comm_hook(state, HOOKS[hook])
    gen = torch.Generator().manual_seed(2000 + rank)
    sums = [None, None]
    per_iter = []
    for it in range(iters):
        micro = [tuple(t.to(device, dtype) for t in make_batch("mlp", gen))
                 for _ in range(3 if option == "no_sync" else 1)]
        for i, m in enumerate((ref, ours)):
            if option == "find_unused":
                m.module.use_side = it % 2 == 0
            for p in m.parameters():
                p.grad = None
            for j, (x, y) in enumerate(micro):
                if j < len(micro) - 1:
                    with m.no_sync():
                        torch.nn.functional.mse_loss(m(x), y).backward()
                else:
                    torch.nn.functional.mse_loss(m(x), y).backward()
            gr = _grads(m.module).cpu().float()
            sums[i] = gr if sums[i] is None else sums[i] + gr
            if i == 1:
                per_iter.append(gr)
    err = ((sums[1] - sums[0]).norm() / sums[0].norm()).item()
    return {"rel_err": err, "grads": per_iter, "finite": all(bool(t.isfinite().all()) for t in per_iter),
            "routes": state.routes()}


def stateless(rank: int, world: int, hook: str, iters: int = 3) -> Dict[str, object]:
    """DDP on the default group with ``hook`` ("allreduce" or "bf16")
    registered with ``state=None``, against DDP without a hook on the same
    data: the relative error of the summed gradients, and this rank's."""
    fn = {"allreduce": hooks.allreduce_hook, "bf16": hooks.bf16_hook}[hook]
    ref = DDP(make_model("mlp"), bucket_cap_mb=0.002)
    ours = DDP(make_model("mlp"), bucket_cap_mb=0.002)
    ours.register_comm_hook(None, fn)
    gen = torch.Generator().manual_seed(3000 + rank)
    sums = [0, 0]
    for _ in range(iters):
        x, y = make_batch("mlp", gen)
        for i, m in enumerate((ref, ours)):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            sums[i] = sums[i] + _grads(m.module)
    return {"rel_err": ((sums[1] - sums[0]).norm() / sums[0].norm()).item(), "grads": _grads(ours.module)}


def joined(rank: int, world: int, hook: str) -> Dict[str, object]:
    """Uneven inputs under ``ddp.join()``: rank r trains 3 + 2r batches; the
    ranks that ran out send zeros through the hook (as DDP does for its own
    all-reduce). DDP with ``hook`` and DDP without one, side by side: this
    rank's final parameters and their relative distance."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    ours = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    ref = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    if hook == "stale":
        ours.register_comm_hook(hooks.StaleState(communicator=comm, staleness=1), hooks.stale_hook)
    else:
        ours.register_comm_hook(_state(hook, comm, "auto", g), HOOKS[hook])
    gen = torch.Generator().manual_seed(4000 + rank)
    batches = [make_batch("mlp", gen) for _ in range(3 + 2 * rank)]
    for m in (ours, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        with m.join():
            for batch in batches:
                train_step(m, opt, batch)
    p, r = (torch.cat([q.detach().reshape(-1) for q in m.parameters()]) for m in (ours, ref))
    return {"params": p, "rel": ((p - r).norm() / r.norm()).item()}


def without_error_feedback(rank: int, world: int, path: str = "auto") -> Dict[str, object]:
    """int4 in blocks of 64 with ``error_feedback=False`` over several buckets:
    the same batch gives the same averaged gradients whatever came before
    (with error feedback the second time would carry the first's residual),
    each close to DDP's exact average, and no residuals anywhere."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    ref = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    ours = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    state = _state("int4", comm, path, g, codec=pycomm.Int4(block=64), error_feedback=False)
    ours.register_comm_hook(state, hooks.int4_hook)
    gen = torch.Generator().manual_seed(3000 + rank)
    a, b = make_batch("mlp", gen), make_batch("mlp", gen)
    got, errs = [], []
    # The first step runs on DDP's first bucket layout (rebuilt after it, so
    # blocks of 64 cut the gradients elsewhere): compare from the second.
    for batch in (b, a, b, a, a):
        for m in (ref, ours):
            for p in m.parameters():
                p.grad = None
            torch.nn.functional.mse_loss(m(batch[0]), batch[1]).backward()
        exact = _grads(ref.module)
        got.append(_grads(ours.module))
        errs.append(((got[-1] - exact).norm() / exact.norm()).item())
    sd = state.state_dict()
    return {"repeat_equal": [bool(torch.equal(got[1], got[i])) for i in (3, 4)], "rel_err": max(errs),
            "differs_from_b": not torch.equal(got[1], got[2]), "grads": got[1], "routes": state.routes(),
            "no_residuals": state.error_feedback is None and all(r is None for r in sd["worker_residuals"])
            and not sd["server_residuals"], "buckets": state.stats()["buckets"]}


def completion_threads(rank: int, world: int) -> Dict[str, object]:
    """Which thread runs the hook, and which completes its future when it
    was still pending on return (rank 1 starts backward late, so rank 0's
    buckets are)."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    seen = {"hook": set(), "done": set(), "pending": 0}
    state = hooks.CompressionState(codec=pycomm.Int8(), communicator=comm, start_iter=0)

    def spy(st, bucket):
        seen["hook"].add(threading.get_ident())
        fut = hooks.int8_hook(st, bucket)
        if fut.done():  # completed before we looked: a callback would run here
            return fut
        seen["pending"] += 1

        def mark(f):
            seen["done"].add(threading.get_ident())
            return f.value()
        return fut.then(mark)

    m = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    m.register_comm_hook(state, spy)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = make_batch("mlp", gen)
        loss = torch.nn.functional.mse_loss(m(x), y)
        if rank == 1:
            time.sleep(0.2)
        loss.backward()
    return {"main": threading.get_ident(), "hook": sorted(seen["hook"]), "done": sorted(seen["done"]),
            "pending": seen["pending"]}


def profile_ranges(rank: int, world: int, hook: str) -> List[str]:
    """Names of the pycomm:: ranges torch.profiler recorded over two steps."""
    g, comm = _group(world)
    if rank >= world:
        return []
    m = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    m.register_comm_hook(_state(hook, comm), HOOKS[hook])
    gen = torch.Generator().manual_seed(rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            x, y = make_batch("mlp", gen)
            torch.nn.functional.mse_loss(m(x), y).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("pycomm::")})


def stats_case(rank: int, world: int) -> Dict[str, object]:
    """Running statistics through the warm-up and the bucket rebuild."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    m = DDP(make_model("mlp"), process_group=g, bucket_cap_mb=0.002)
    state = hooks.CompressionState(codec=pycomm.Int8(), communicator=comm, start_iter=2)
    seen: list = []
    m.register_comm_hook(state, _counting(hooks.int8_hook, seen))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = make_batch("mlp", gen)
        torch.nn.functional.mse_loss(m(x), y).backward()
    return {"stats": state.stats(), "calls": len(seen), "after_warm_up": sum(1 for it, _ in seen if it >= 2),
            "last_buckets": sum(1 for it, _ in seen if it == 4), "ef_keys": len(state.error_feedback)}


def local_sgd_case(rank: int, world: int, period: int, warmup: int, steps: int) -> Dict[str, object]:
    """DDP with local_sgd_hook and LocalSGD: returns, per step, every rank's
    parameters (gathered), and the averages the wrapper made."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    m = DDP(make_model("mlp"), process_group=g)
    m.register_comm_hook(hooks.LocalSGDState(communicator=comm, start_iter=warmup), hooks.local_sgd_hook)
    opt = hooks.LocalSGD(torch.optim.SGD(m.parameters(), lr=0.2), period=period, warmup_steps=warmup,
                         communicator=comm)
    gen = torch.Generator().manual_seed(300 + rank)
    spreads = []
    for _ in range(steps):
        x, y = make_batch("mlp", gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=g)
        spreads.append(max((t - gathered[0]).abs().max().item() for t in gathered))
    return {"spreads": spreads, "averages": opt.averages}


def local_sgd_grad_scaler(rank: int, world: int, period: int = 2, steps: int = 8, overflow_at: int = 3
                          ) -> Dict[str, object]:
    """hooks.LocalSGD without a warm-up (each rank steps alone) under
    GradScaler and an LR scheduler on the wrapper; rank 0's step
    ``overflow_at`` overflows, so only its scaler skips it. Every rank must
    still average at the same steps, ending on the same parameters."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    model = make_model("mlp")
    opt = hooks.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.2), period=period, communicator=comm)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    gen = torch.Generator().manual_seed(310 + rank)
    for t in range(1, steps + 1):
        x, y = make_batch("mlp", gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if t == overflow_at and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=g)
    return {"averages": opt.averages, "step_count": opt.step_count, "scale": scaler.get_scale(),
            "spread": max((t - gathered[0]).abs().max().item() for t in gathered),
            "lr": opt.optimizer.param_groups[0]["lr"]}


def local_sgd_average(rank: int, world: int) -> float:
    """LocalSGD.average on random per-rank parameters equals their mean."""
    g, comm = _group(world)
    if rank >= world:
        return 0.0
    torch.manual_seed(50 + rank)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5, 3))]
    opt = hooks.LocalSGD(torch.optim.SGD(params, lr=0.1), period=1, communicator=comm)
    expected = [p.detach().clone() for p in params]
    for e in expected:
        dist.all_reduce(e, group=g)
        e /= world
    opt.average()
    return max((p - e).abs().max().item() for p, e in zip(params, expected))


# ---------------------------------------------------------------- convergence


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 450
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def digits_mlp() -> torch.nn.Module:
    """The digits recipe's MLP (64 -> 128 -> 128 -> 10), from torch's current seed."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def digits_accuracy(rank: int, world: int, hook: Optional[str], steps: int, start_iter: int = 0,
                    ratio: float = 0.01, seed: int = 0, exact: bool = True, path: str = "auto",
                    device: str = "cpu", lr: float = 0.1) -> float:
    """An MLP on scikit-learn's digits: each rank trains on its quarter of a
    global batch of 64 for ``steps`` steps (SGD with momentum, cosine decay to
    zero, so every run ends converged); accuracy on a held-out split."""
    g, comm = _group(world)
    if rank >= world:
        return 0.0
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(seed)
    model = digits_mlp()
    model = model.to(device)
    xtr, ytr, xte, yte = (t.to(device) for t in (xtr, ytr, xte, yte))
    m = DDP(model, process_group=g)
    where = (dict(communicator=comm) if path == "auto" and device == "cpu"
             else dict(process_group=g, path=path))
    if hook == "int8":
        m.register_comm_hook(hooks.CompressionState(codec=pycomm.Int8(), start_iter=start_iter, **where),
                             hooks.int8_hook)
    elif hook == "topk":
        m.register_comm_hook(hooks.CompressionState(codec=pycomm.TopK(ratio, exact=exact), start_iter=start_iter,
                                                    **where), hooks.topk_hook)
    elif hook is not None and hook.startswith("powersgd"):  # e.g. "powersgd4", "powersgd4-int8"
        r, _, wire = hook[len("powersgd"):].partition("-")
        m.register_comm_hook(hooks.PowerSGDState(rank=int(r), start_iter=max(start_iter, 2),
                                                 wire=pycomm.Int8() if wire == "int8" else None, **where),
                             hooks.powersgd_hook)
    elif hook is not None and hook.startswith("stale"):  # e.g. "stale1", "stale1-int8"
        s, _, wire = hook[len("stale"):].partition("-")
        wires = {"int8": pycomm.Int8(), "powersgd4": hooks.PowerSGD(4), "": None}
        stale = hooks.StaleState(staleness=int(s), wire=wires[wire], **where)
        m.register_comm_hook(stale, hooks.stale_hook)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(7 + seed)  # the same global batches on every rank
    per_rank = 64 // world
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (64,), generator=gen)[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(xtr[idx]), ytr[idx]).backward()
        opt.step()
        sched.step()
    if hook is not None and hook.startswith("stale"):
        for _ in stale.flush():  # the averages still in flight (the schedule has reached lr 0)
            opt.step()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item() * 100


# ---------------------------------------------------------------- policy and checkpoints


class _FakeCudaBuffer:
    """What the policy reads of a bucket: its device (no CUDA needed)."""
    device = torch.device("cuda", 0)


def policy_decisions(rank: int, world: int) -> Dict[str, object]:
    """Each branch of the hook policy, with the line it logs; the peers' facts
    the IPC decision reads are faked where this machine has no GPU."""
    import logging

    g, comm = _group(world)
    if rank >= world:
        return {}
    lines: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("pycomm")
    handler, old = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out: Dict[str, object] = {}
    try:
        cpu = torch.randn(4)
        out["cpu_auto"] = hooks.AllReduceState(communicator=comm)._route(cpu, False)
        out["cpu_group"] = hooks.AllReduceState(g, path="group")._route(cpu, True)
        try:
            hooks.AllReduceState(g, path="ipc")._route(cpu, False)
        except pycomm.CommError as e:
            out["cpu_ipc"] = str(e)
        fake = _FakeCudaBuffer()
        st = hooks.CompressionState(g)
        out["cuda_compressed"] = st._route(fake, True)
        # One Int8/Int4 all-reduce per bucket (the compressed hooks): CUDA IPC
        # where it can go, else the group path.
        for name, reason in (("cuda_quantized_ipc", None), ("cuda_quantized_group", "ranks share a GPU")):
            st = hooks.CompressionState(g)
            st._ipc_refusal = lambda device, r=reason: r
            out[name] = st._route(fake, True, quantized=True)
        for name, reason in (("cuda_plain_ipc", None), ("cuda_plain_group", "the ranks span several hosts")):
            st = hooks.AllReduceState(g)
            st._ipc_refusal = lambda device, r=reason: r
            out[name] = st._route(fake, False)
            st._route(fake, False)  # decided once: logged once
        try:
            hooks.AllReduceState(communicator=comm)._route(fake, False)
        except pycomm.CommError as e:
            out["cuda_with_communicator"] = str(e)
        os_env = __import__("os").environ
        os_env["PYCOMM_HOOK_PATH"] = "group"
        try:
            out["env_path"] = hooks.AllReduceState(g).path
        finally:
            del os_env["PYCOMM_HOOK_PATH"]
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    out["lines"] = lines
    out["refusals"] = [hooks.ipc_refusal(r) for r in (
        [("h", "g0", True), ("h", "g1", True)], [("h", "g0", True), ("h2", "g1", True)],
        [("h", "g0", True), ("h", "g0", True)], [("h", "g0", True), ("h", "g1", False)],
        [("h", f"g{i}", True) for i in range(9)])]
    return out


def checkpoint_resume(rank: int, world: int, hook: str, path: str = "auto", model: str = "linear"
                      ) -> Dict[str, object]:
    """Train 4 steps; at step 2 save the hook state (and model and optimizer),
    restore them into a fresh DDP model and hook state, run steps 3-4 on
    both. Returns whether the resumed run's parameters equal the uninterrupted
    one's, and how far they are from them with and without the hook's state.
    (A fresh DDP compresses its first step in its first bucket layout, so
    only a model whose layout does not change can be resumed bit for bit.)"""
    g, comm = _group(world)
    if rank >= world:
        return {}

    def fresh():
        m = DDP(make_model(model), process_group=g, bucket_cap_mb=0.002)
        st = _state(hook, comm, path, g)
        m.register_comm_hook(st, HOOKS[hook])
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), st

    gen = torch.Generator().manual_seed(3000 + rank)
    batches = [make_batch("mlp", gen) for _ in range(4)]
    m, opt, st = fresh()
    for b in batches[:2]:
        train_step(m, opt, b)
    ckpt = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "opt": opt.state_dict(),
            "hook": st.state_dict()}
    import io
    buf = io.BytesIO()
    torch.save(ckpt, buf)  # a real round trip through serialization
    for b in batches[2:]:
        train_step(m, opt, b)
    m2, opt2, st2 = fresh()
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    st2.load_state_dict(ckpt["hook"])
    for b in batches[2:]:
        train_step(m2, opt2, b)
    def dist_to(other):
        return max((a - b).abs().max().item() for a, b in zip(m.parameters(), other.parameters()))

    same = all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    # Without the hook's state the resumed run differs (the residuals matter).
    m3, opt3, st3 = fresh()
    m3.load_state_dict(ckpt["model"])
    opt3.load_state_dict(ckpt["opt"])
    st3.load_state_dict({"iteration": ckpt["hook"]["iteration"]})
    for b in batches[2:]:
        train_step(m3, opt3, b)
    return {"same": same, "with": dist_to(m2), "without": dist_to(m3), "iteration": st2.iteration,
            "saved": sum(t is not None for t in ckpt["hook"].get("worker_residuals", []))}


def checkpoint_other_world(rank: int, world: int) -> Dict[str, object]:
    """int8 with error feedback: 2 steps on 4 ranks, then each of ranks 0
    and 1 resumes its checkpoint in a job of 2 ranks. The bucket's shard has
    256 elements at both sizes, but other elements at each: the server
    residual must restart from zero (one step equals, bit for bit, a resume
    whose checkpoint had none), while relabelled as coming from 2 ranks it
    is restored (the step differs). The worker residual carries over."""
    g4, comm4 = _group(4)
    gen = torch.Generator().manual_seed(5000 + rank)
    batches = [make_batch("linear", gen) for _ in range(3)]
    ckpt = None
    if rank < 4:
        m = DDP(make_model("linear"), process_group=g4)
        st = _state("int8", comm4, "auto", g4)
        m.register_comm_hook(st, HOOKS["int8"])
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for b in batches[:2]:
            train_step(m, opt, b)
        ckpt = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "hook": st.state_dict()}
    out: Dict[str, object] = {}
    g2, comm2 = _group(2)
    if rank >= 2:
        return out
    assert ckpt is not None
    out["saved world"] = ckpt["hook"].get("world_size")
    out["saved servers"] = len(ckpt["hook"]["server_residuals"])

    def resume(hook_state: Dict[str, object]) -> List[torch.Tensor]:
        m2 = DDP(make_model("linear"), process_group=g2)
        m2.load_state_dict(ckpt["model"])
        st2 = _state("int8", comm2, "auto", g2)
        st2.load_state_dict(hook_state)
        m2.register_comm_hook(st2, HOOKS["int8"])
        train_step(m2, torch.optim.SGD(m2.parameters(), lr=0.05), batches[2])
        out.setdefault("world after", []).append(st2.state_dict().get("world_size"))
        return [p.detach().clone() for p in m2.parameters()]

    as_saved = resume(ckpt["hook"])
    no_server = resume(dict(ckpt["hook"], server_residuals={}))
    relabelled = resume(dict(ckpt["hook"], world_size=2))
    no_worker = resume(dict(ckpt["hook"], server_residuals={}, worker_residuals=[]))
    out["restarts from zero"] = all(torch.equal(a, b) for a, b in zip(as_saved, no_server))
    out["relabelled restores"] = not all(torch.equal(a, b) for a, b in zip(relabelled, no_server))
    out["worker carries over"] = not all(torch.equal(a, b) for a, b in zip(no_server, no_worker))
    return out


def sparse_embedding(rank: int, world: int, hook: str, path: str = "auto", device: str = "cpu"
                     ) -> Dict[str, object]:
    """DDP over a model with a sparse embedding, under ``hook``: the
    embedding's gradient stays sparse and equals DDP's without a hook (the
    average of every rank's) at every step, including PowerSGD's steps (its
    sparse bucket is the last one: the one before must still finish) and the
    stale hook's (sparse buckets are not delayed)."""
    g, comm = _group(world)
    if rank >= world:
        return {}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.EmbeddingBag(60, 8, mode="sum", sparse=True), torch.nn.Linear(8, 16),
                                   torch.nn.Tanh(), torch.nn.Linear(16, 4))

    ref_model, model_ = model().to(device), model().to(device)
    ref = DDP(ref_model, process_group=g)
    # Small buckets: the dense layers take two, the embedding (first in the
    # model, last in the backward) one of its own.
    ddp = DDP(model_, process_group=g, bucket_cap_mb=0.0005)
    if hook == "stale":
        on_comm = path == "auto" and device == "cpu"
        state = hooks.StaleState(None if on_comm else g, staleness=1, wire=torch.bfloat16,
                                 **(dict(communicator=comm) if on_comm else dict(path=path)))
        ddp.register_comm_hook(state, hooks.stale_hook)
    else:
        state = _state(hook, comm, path=path, group=g, start_iter=2, device=device)
        ddp.register_comm_hook(state, HOOKS[hook])
    diff, sparse = 0.0, True
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randint(0, 60, (6, 3), generator=gen).to(device), torch.randn(6, 4, generator=gen).to(device)
        for m in (ref, ddp):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        got, want = model_[0].weight.grad, ref_model[0].weight.grad
        sparse = sparse and got.is_sparse
        diff = max(diff, float((got.to_dense() - want.to_dense()).abs().max().cpu()))
    return {"diff": diff, "sparse": sparse, "routes": state.routes(),
            "dense_finite": all(bool(p.grad.isfinite().all()) for p in model_[1:].parameters())}

