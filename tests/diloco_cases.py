"""Worker-side cases for pycomm.DiLoCo (tests/test_diloco.py): a quadratic
whose every rank's path is known in float64, checkpoints and digits."""
from __future__ import annotations

import io
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import pycomm
from hooks_cases import _digits, _group, digits_mlp, init_default, make_batch, make_model  # noqa: F401 (init_default: the pool's set-up)

SHAPES = [(20, 30), (600,), (7, 5, 3)]
WIRES = {"plain": None, "bf16": torch.bfloat16, "int8": pycomm.Int8(), "int4": pycomm.Int4()}


def _targets(world: int) -> List[List[torch.Tensor]]:
    """Rank r's quadratic 1/2 |theta - c_r|^2, c_r drawn from r's seed (every rank can draw them all)."""
    return [[torch.randn(*s, generator=torch.Generator().manual_seed(100 * r + i), dtype=torch.float64)
             for i, s in enumerate(SHAPES)] for r in range(world)]


def _simulate(world: int, steps: int, lr: float, h: int, fragments: List[int], offsets: List[int],
              overlap: int, outer_lr: float, mu: float, skip: Optional[Dict[int, int]] = None,
              alpha: Optional[float] = None) -> List[List[torch.Tensor]]:
    """Every rank's parameters after each step, in float64: inner SGD on each
    rank's quadratic, fragment f's outer Nesterov step at its sync steps
    (torch's SGD: buf = g first, then mu * buf + g; update g + mu * buf),
    applied ``overlap`` (tau) steps later, the ranks then on the global
    parameters plus their progress since the sync (``alpha`` None) or on
    alpha * theirs + (1 - alpha) * global.
    ``skip``: {step: rank} whose inner update that step is skipped."""
    skip = skip or {}
    cs = _targets(world)
    theta = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    xs = [[t.clone() for t in theta] for _ in range(world)]
    bufs: Dict[int, List[torch.Tensor]] = {}
    pending: Dict[int, tuple] = {}
    history = []
    nfrag = max(fragments) + 1

    def outer(f, delta):
        members = [i for i, fr in enumerate(fragments) if fr == f]
        if f not in bufs:
            bufs[f] = [delta[i].clone() for i in members]
        else:
            for k, i in enumerate(members):
                bufs[f][k] = mu * bufs[f][k] + delta[i]
        for k, i in enumerate(members):
            theta[i] = theta[i] - outer_lr * (delta[i] + mu * bufs[f][k])

    def merge(f, at_sync):
        for r in range(world):
            for i, fr in enumerate(fragments):
                if fr == f:
                    xs[r][i] = (theta[i] + (xs[r][i] - at_sync[r][i]) if alpha is None
                                else alpha * xs[r][i] + (1 - alpha) * theta[i])

    for t in range(1, steps + 1):
        for r in range(world):
            if skip.get(t) != r:
                xs[r] = [x - lr * (x - c) for x, c in zip(xs[r], cs[r])]
        for f in sorted(pending):
            delta, at_sync, due = pending[f]
            if due == t:
                outer(f, delta)
                merge(f, at_sync)
                del pending[f]
        for f in range(nfrag):
            if t % h == offsets[f] % h:
                delta = {i: sum(theta[i] - xs[r][i] for r in range(world)) / world
                         for i, fr in enumerate(fragments) if fr == f}
                at_sync = [[x.clone() for x in xs[r]] for r in range(world)]
                if overlap:
                    pending[f] = (delta, at_sync, t + overlap)
                else:
                    outer(f, delta)
                    merge(f, at_sync)
        history.append([[x.clone() for x in xs[r]] for r in range(world)])
    return history


def _route(world: int, device: str, path: Optional[str]) -> Dict[str, object]:
    """Where pseudo-gradients go: the communicator for CPU parameters, the
    group (the path CUDA parameters take) for CUDA ones or when asked."""
    group, comm = _group(world)
    if device == "cpu" and path is None:
        return {"communicator": comm}
    return {"process_group": group, "path": path}


def quadratic(rank: int, world: int, wire: str, fragments: int, overlap: int, steps: int = 20,
              h: int = 4, outer: str = "default", device: str = "cpu", path: Optional[str] = None,
              alpha: Optional[float] = None, backup_device: Optional[str] = None) -> Dict[str, object]:
    """pycomm.DiLoCo on the quadratic against the float64 simulation: the
    largest difference over every step, relative to the targets' scale.
    ``outer`` "averaging": the outer optimizer passed as ``outer=``, plain
    SGD at lr 1 (the global parameters become the ranks' average)."""
    if rank >= world:
        return {}
    params = [torch.zeros(s, device=device, requires_grad=True) for s in SHAPES]
    inner = torch.optim.SGD(params, lr=0.1)
    kw = dict(outer=lambda groups: torch.optim.SGD(groups, lr=1.0)) if outer == "averaging" else {}
    opt = pycomm.DiLoCo(params, inner, sync_every=h, fragments=fragments, overlap=overlap, wire=WIRES[wire],
                        alpha=alpha, backup_device=backup_device, **_route(world, device, path), **kw)
    which = [next(f for f, fr in enumerate(opt._fragments) if any(p is q for q in fr.local)) for p in params]
    offsets = [fr.offset for fr in opt._fragments]
    want = _simulate(world, steps, 0.1, h, which, offsets, int(overlap),
                     *((1.0, 0.0) if outer == "averaging" else (0.7, 0.9)), alpha=alpha)
    cs = [c.float().to(device) for c in _targets(world)[rank]]
    worst = 0.0
    for t in range(steps):
        opt.zero_grad()
        sum(0.5 * ((p - c) ** 2).sum() for p, c in zip(params, cs)).backward()
        opt.step()
        worst = max(worst, max((p.detach().double().cpu() - w).abs().max().item() for p, w in zip(params, want[t][rank])))
    opt.sync()
    final = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
    glob = [t for fr in opt._fragments for t in fr.glob]
    kept = glob + [v for st in opt.outer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"worst": worst, "final": final, "outer_steps": opt.outer_steps, "fragments": len(opt._fragments),
            "kept_on": sorted({str(t.device) for t in kept}),
            # The global parameters are pinned (the outer state is the outer optimizer's own).
            "pinned": all(t.is_pinned() for t in glob) if device == "cuda" and backup_device == "cpu" else None}


def grad_scaler(rank: int, world: int, fragments: int, overlap: bool, fused: bool, unscale_first: bool,
                steps: int = 20, h: int = 4, device: str = "cpu", path: Optional[str] = None) -> Dict[str, object]:
    """The quadratic under ``torch.amp.GradScaler`` (``scaler.step(opt)``),
    the scale 2^10, with overflows on one rank only (inner steps are not
    averaged, so only that rank's scaler skips): rank 0 at step 6, the last
    rank at step 9. The float64 simulation skips those ranks' inner updates
    and keeps every sync where it was."""
    if rank >= world:
        return {}
    params = [torch.zeros(s, device=device, requires_grad=True) for s in SHAPES]
    inner = torch.optim.SGD(params, lr=0.1, fused=fused)
    opt = pycomm.DiLoCo(params, inner, sync_every=h, fragments=fragments, overlap=overlap,
                        **_route(world, device, path))
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=1000)
    which = [next(f for f, fr in enumerate(opt._fragments) if any(p is q for q in fr.local)) for p in params]
    skip = {6: 0, 9: world - 1}
    want = _simulate(world, steps, 0.1, h, which, [fr.offset for fr in opt._fragments], int(overlap), 0.7, 0.9,
                     skip)
    cs = [c.float().to(device) for c in _targets(world)[rank]]
    worst, scales = 0.0, []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss = sum(0.5 * ((p - c) ** 2).sum() for p, c in zip(params, cs))
        if skip.get(t) == rank:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)  # as before clipping
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        worst = max(worst, max((p.detach().double().cpu() - w).abs().max().item()
                               for p, w in zip(params, want[t - 1][rank])))
    opt.sync()
    return {"worst": worst, "final": torch.cat([p.detach().reshape(-1) for p in params]).cpu(), "scales": scales,
            "local_step": opt.local_step, "outer_steps": opt.outer_steps}


def as_an_optimizer(rank: int, world: int) -> Dict[str, object]:
    """DiLoCo where torch expects an optimizer: an LR scheduler on the wrapper
    sets the inner optimizer's rate (the same rates as on the inner one),
    step hooks run once per step, checkpoints of both round-trip."""
    _, comm = _group(world)
    if rank >= world:
        return {}
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    inner = torch.optim.AdamW(params, lr=1e-2)
    opt = pycomm.DiLoCo(params, inner, sync_every=4, communicator=comm)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12)
    twin = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2)
    twin_sched = torch.optim.lr_scheduler.OneCycleLR(twin, max_lr=0.05, total_steps=12)
    hooks = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda o, a, k: hooks.__setitem__("pre", hooks["pre"] + 1))
    opt.register_step_post_hook(lambda o, a, k: hooks.__setitem__("post", hooks["post"] + 1))
    cs = [c.float() for c in _targets(world)[rank]]
    rates, twin_rates = [], []
    for _ in range(12):
        opt.zero_grad()
        sum(0.5 * ((p - c) ** 2).sum() for p, c in zip(params, cs)).backward()
        opt.step()
        twin.step()
        sched.step()
        twin_sched.step()
        rates.append(inner.param_groups[0]["lr"])
        twin_rates.append(twin.param_groups[0]["lr"])
    try:
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
        refused = ""
    except NotImplementedError as e:
        refused = str(e)
    adam = pycomm.DiLoCo(params, inner, communicator=comm, outer=lambda groups: torch.optim.Adam(groups, lr=1e-3))
    return {"adam_outer": (isinstance(adam.outer, torch.optim.Adam), len(adam.outer.param_groups)),
            "is_optimizer": isinstance(opt, torch.optim.Optimizer), "rates": rates, "twin_rates": twin_rates,
            "hooks": hooks, "refused": refused, "outer_steps": opt.outer_steps,
            "sched_state": sched.state_dict()["last_epoch"], "repr": repr(opt)}


def built_differently(rank: int, world: int, what: str) -> str:
    """Rank 1 builds DiLoCo otherwise than the rest (``what``: its sync_every,
    its wire, or one of its parameter's shapes); the error each rank raises at
    construction (none: "")."""
    _, comm = _group(world)
    if rank >= world:
        return ""
    shapes = [(30, 20) if what == "shape" and rank == 1 and s == (20, 30) else s for s in SHAPES]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    kw = dict(sync_every=8 if what == "sync_every" and rank == 1 else 4,
              wire=pycomm.Int8(block=128) if what == "block" and rank == 1 else pycomm.Int8())
    if what == "alpha":
        kw["alpha"] = 0.5 if rank == 1 else 0.4
    try:
        pycomm.DiLoCo(params, torch.optim.SGD(params, lr=0.1), communicator=comm, **kw)
    except ValueError as e:
        return str(e)
    return ""


def _same_as(mine: torch.Tensor, peer: int) -> bool:
    """Whether ``peer`` holds what this rank holds (both send theirs)."""
    other = torch.empty_like(mine)
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, other, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return torch.equal(mine, other)


def fsdp_within_wrapper_across(rank: int, world: int, wrapper: str, steps: int = 8) -> Dict[str, object]:
    """4 ranks as 2 hosts x 2: DDP or FSDP2 (which shards the model) within
    a host, DiLoCo (H = 4) or hooks.LocalSGD (period 4) between hosts over
    its own process group (with FSDP2, between the ranks holding the same
    shards). Per way: the whole parameters after ``steps``, and per step
    whether this rank's parameters (or shards) equal those of its peer on the
    other host and of its peer on this one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm import hooks

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("between", "within"))
    between = mesh["between"].get_group()

    def wrap(params):
        inner = torch.optim.SGD(params, lr=0.1)
        if wrapper == "diloco":
            # Plain pseudo-gradients: int8 blocks would cut shards and whole
            # tensors differently, and round them differently.
            return pycomm.DiLoCo(params, inner, sync_every=4, process_group=between)
        return hooks.LocalSGD(inner, period=4, process_group=between)

    out: Dict[str, object] = {}
    for how in ("fsdp", "ddp"):
        model = make_model("mlp")
        if how == "fsdp":
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh["within"])
            fully_shard(model, mesh=mesh["within"])
            run = model
        else:
            run = DDP(model, process_group=mesh["within"].get_group())
        opt = wrap(list(model.parameters()))
        gen = torch.Generator().manual_seed(100 + rank)
        met, within = [], []
        for _ in range(steps):
            x, y = make_batch("mlp", gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(run(x), y).backward()
            opt.step()
            mine = torch.cat([(p.to_local() if how == "fsdp" else p).detach().reshape(-1)
                              for p in model.parameters()])
            met.append(_same_as(mine, (rank + 2) % 4))
            within.append(_same_as(mine, rank ^ 1))
        full = [p.full_tensor() if how == "fsdp" else p for p in model.parameters()]
        out[how] = {"whole": torch.cat([p.detach().reshape(-1) for p in full]), "met": met, "within": within}
    return out


def checkpoint(rank: int, world: int, wire: str = "plain") -> Dict[str, object]:
    """12 steps (H = 4, 2 fragments); at step 6 save the wrapper's state
    through torch.save, resume a fresh one, run to 12: the same parameters
    (with an int8 / int4 wire, only if the residuals came back too)."""
    _, comm = _group(world)
    if rank >= world:
        return {}
    cs = [c.float() for c in _targets(world)[rank]]

    def fresh():
        params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
        return params, pycomm.DiLoCo(params, torch.optim.SGD(params, lr=0.1, momentum=0.5), sync_every=4,
                                     fragments=2, communicator=comm, wire=WIRES[wire])

    def run(params, opt, n):
        for _ in range(n):
            opt.zero_grad()
            sum(0.5 * ((p - c) ** 2).sum() for p, c in zip(params, cs)).backward()
            opt.step()

    params, opt = fresh()
    run(params, opt, 6)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    run(params, opt, 6)
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    params2, opt2 = fresh()
    with torch.no_grad():
        for p, q in zip(params2, ckpt["params"]):
            p.copy_(q)
    opt2.load_state_dict(ckpt["opt"])
    run(params2, opt2, 6)
    return {"same": all(torch.equal(a, b) for a, b in zip(params, params2)), "outer_steps": opt2.outer_steps}


def digits(rank: int, world: int, h: Optional[int], steps: int = 500, fragments: int = 1, overlap: bool = False,
           wire: str = "plain", seed: int = 0, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> float:
    """The digits MLP (tests/hooks_cases.py's recipe: SGD with momentum 0.9,
    lr 0.1, cosine decay, global batch 64) under DiLoCo with H = ``h`` inner
    steps, or synchronous averaging of every step's gradients (``h`` None)."""
    _, comm = _group(world)
    if rank >= world:
        return 0.0
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(seed)
    model = digits_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # The model itself as DiLoCo's params (as TorchFT's DiLoCo takes it).
    opt = (pycomm.DiLoCo(model, inner, sync_every=h, fragments=fragments, overlap=overlap,
                         wire=WIRES[wire], communicator=comm, outer_lr=outer_lr, outer_momentum=outer_momentum)
           if h else inner)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)  # on the wrapper: it sets the inner's rate
    gen = torch.Generator().manual_seed(7 + seed)
    per_rank = 64 // world
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (64,), generator=gen)[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        if h is None:
            comm.all_reduce_coalesced([p.grad for p in model.parameters()], op="avg")
        opt.step()
        sched.step()
    if h:
        opt.sync()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item() * 100
