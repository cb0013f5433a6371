"""Fault-tolerant DDP training on digits (pycomm.elastic.FaultTolerantDDP),
in ranks forked from a zygote (reliability_cases): kill -9 of a rank at a
random step and moment, a replacement that joins, every pycomm hook."""
from __future__ import annotations

import functools
import hashlib
import os
import random
import signal
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

import pycomm
from pycomm import hooks
from pycomm.elastic import FaultTolerantDDP

HOOKS = ("allreduce", "bf16", "int8", "int4", "topk", "stale1", "localsgd")
GLOBAL_BATCH = 64


_DATA: list = []


def _digits():
    if not _DATA:
        from hooks_cases import _digits as load

        _DATA.extend(load())
    return _DATA


def preload() -> None:
    """Imports and data every rank needs, loaded once in the process the
    ranks fork from (sklearn and torch's optimizer imports take seconds)."""
    _digits()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each


def make_hook(name: str, optimizer: torch.optim.Optimizer, path: Optional[str] = None):
    """(hook, state, optimizer) for one of HOOKS; start_iter 5 so that the
    compressed hooks compress through most of the run; ``path="group"``: the
    buckets go over a Gloo group per membership epoch."""
    if name == "allreduce":
        return hooks.allreduce_hook, hooks.AllReduceState(path=path), optimizer
    if name == "bf16":
        return hooks.bf16_hook, hooks.AllReduceState(path=path), optimizer
    if name in ("int8", "int4"):
        codec = pycomm.Int8() if name == "int8" else pycomm.Int4()
        return getattr(hooks, f"{name}_hook"), hooks.CompressionState(codec=codec, start_iter=5, path=path), optimizer
    if name == "topk":
        return hooks.topk_hook, hooks.CompressionState(codec=pycomm.TopK(0.05), start_iter=5, path=path), optimizer
    if name == "stale1":
        return hooks.stale_hook, hooks.StaleState(staleness=1, path=path), optimizer
    if name == "localsgd":
        comm_free = hooks.LocalSGDState(start_iter=20, path=path)
        return hooks.local_sgd_hook, comm_free, None  # the LocalSGD optimizer is built on the communicator
    raise ValueError(name)


def digest(ft: FaultTolerantDDP, optimizer: bool = True) -> str:
    """A hash of the parameters and (``optimizer``) the optimizer state, bitwise."""
    h = hashlib.sha256()
    for p in ft.module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    if not optimizer:
        return h.hexdigest()[:16]
    opt = ft.optimizer.optimizer if isinstance(ft.optimizer, hooks.LocalSGD) else ft.optimizer
    for p in ft.module.parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            h.update(k.encode())
            h.update(v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def train(comm: pycomm.Communicator, hook: str, steps: int, *, lr: float = 0.05, kill_at: Optional[tuple] = None,
          on_step=None, bucket_cap_mb: float = 0.03, admit_every: int = 0, on_failure: str = "redo",
          freeze: bool = False, path: Optional[str] = None, device: str = "cpu", amp: bool = False,
          **bounds: Any) -> Dict[str, Any]:
    """Train the digits MLP for ``steps`` steps with FaultTolerantDDP; the
    global batch of step s is the same on every rank and split over the
    current world. ``kill_at=(step, phase)`` kills this process at that step:
    phase 0 before the forward, 1 inside the backward (before its buckets go
    out), 2 after the backward (its peers may complete the step); with
    ``freeze`` it stops there instead (SIGSTOP, until the test continues it).
    ``path="group"``: the buckets go over a Gloo group per epoch;
    ``device="cuda"``: a CUDA model (the group path, NCCL or Gloo).
    ``amp``: loss scaling through ``grad_scaler=``, each rank's scaler built
    with another initial scale (the wrapper's first heal makes them equal),
    and rank 0's loss overflowing at step 15 (every rank must skip it).
    ``bounds``: the wrapper's max_world_size, min_world_size and
    min_world_timeout."""
    from hooks_cases import digits_mlp

    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(comm.rank + 100)  # different on every rank: the wrapper's first heal makes them equal
    if device == "cuda":  # a GPU per rank where there are enough, else shared
        device = f"cuda:{comm.rank % torch.cuda.device_count()}"
    model = digits_mlp().to(device)
    xtr, ytr, xte, yte = (t.to(device) for t in (xtr, ytr, xte, yte))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hook_fn, state, wrapped = make_hook(hook, opt, path)
    if wrapped is None:
        wrapped = hooks.LocalSGD(opt, period=4, warmup_steps=20, communicator=comm)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    scaler = (torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** (10 + comm.rank), growth_interval=25)
              if amp else None)
    ft = FaultTolerantDDP(model, wrapped, comm, hook=hook_fn, state=state, scheduler=sched,
                          bucket_cap_mb=bucket_cap_mb, admit_every=admit_every, on_failure=on_failure,
                          grad_scaler=scaler, **bounds)
    scales: List[float] = []
    first = model[0].weight
    digests: Dict[int, str] = {}
    sig = signal.SIGSTOP if freeze else signal.SIGKILL

    def kill_in_backward(grad):
        if kill_at is not None and ft.steps_done == kill_at[0] and kill_at[1] == 1:
            os.kill(os.getpid(), sig)
        return grad

    first.register_hook(kill_in_backward)

    def step_fn(step: int) -> float:
        digests.setdefault(step, digest(ft))
        if on_step is not None:
            on_step(ft, step)
        if kill_at is not None and step == kill_at[0] and kill_at[1] == 0:
            os.kill(os.getpid(), sig)
        idx = torch.randint(0, len(xtr), (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(1000 + step))
        mine = torch.tensor_split(idx, ft.world_size)[ft.rank].to(device)
        loss = torch.nn.functional.cross_entropy(ft(xtr[mine]), ytr[mine])
        if scaler is not None:
            scales.append(scaler.get_scale())
            (scaler.scale(loss * float("inf") if step == 15 and ft.rank == 0 else loss)).backward()
        else:
            loss.backward()
        if kill_at is not None and step == kill_at[0] and kill_at[1] == 2:
            os.kill(os.getpid(), sig)
        return loss.item()

    ft.train(steps, step_fn)
    if isinstance(state, hooks.StaleState):
        for _ in state.flush():  # the schedule has reached lr 0: nothing moves
            opt.step()
    with torch.no_grad():
        acc = (ft.module(xte).argmax(1) == yte).float().mean().item() * 100
    return dict(acc=acc, digest=digest(ft), params=digest(ft, optimizer=False), steps=ft.steps_done,
                world=ft.world_size, rank=ft.rank, routes=state.routes(),
                cuda_backend=ft.group.cuda_backend if ft.group is not None else None,
                epoch=ft.comm.epoch, events=ft.events, digests=digests, stats=state.stats(),
                scales=scales + ([scaler.get_scale()] if scaler is not None else []))


def _collect(procs: int, target, *args: Any, dead: tuple = (), frozen: tuple = ()) -> Dict[str, Any]:
    """Forks a store and ``procs`` ranks running ``target``; every report but
    the dead ranks', the hung count and what stayed in /dev/shm. ``frozen``
    ranks stop themselves: once the others reported, they are continued
    (SIGCONT) and report too."""
    import reliability_cases as rc

    before = rc.shm_entries()
    store_pid, pids, conns = rc.fork_ranks(procs, target, *args)
    reports: Dict[int, Any] = {}
    deadline = time.monotonic() + rc.START_S + 90
    order = [r for r in range(procs) if r not in frozen] + list(frozen)
    for r in order:
        c = conns[r]
        if r in dead:
            continue
        if r in frozen:
            os.kill(pids[r], signal.SIGCONT)
        if c.poll(max(0.0, deadline - time.monotonic())):
            try:
                reports[r] = c.recv()
            except EOFError:
                reports[r] = dict(crash="exited without a report")
        else:
            reports[r] = dict(crash="no report (hang)")
    hung = rc.reap(pids, time.monotonic() + 10)
    os.kill(store_pid, signal.SIGKILL)
    os.waitpid(store_pid, 0)
    return dict(reports=reports, hung=len(hung), leaked=sorted(rc.shm_entries() - before))


def _report(fn, rank: int, procs: int, port: int, conn, *args: Any) -> None:
    try:
        conn.send(fn(rank, procs, port, *args))
    except BaseException as e:  # noqa: BLE001 - the test shows what went wrong
        conn.send(dict(crash=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _reporting(fn):
    """A rank target that sends fn's result (or its crash) to the caller;
    a partial, not a closure: spawned ranks receive it pickled."""
    return functools.partial(_report, fn)


def _ft_rank(rank: int, world: int, port: int, hook: str, steps: int, kills: Dict[int, tuple],
             comm_kwargs: Dict[str, Any], train_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    import reliability_cases as rc

    heartbeat = train_kwargs.pop("heartbeat", None)
    _store, comm = rc._bootstrap(rank, world, port, "ft", 20.0, **comm_kwargs)
    if heartbeat is not None:
        comm.heartbeat_timeout = heartbeat
    return train(comm, hook, steps, kill_at=kills.get(rank), **train_kwargs)


def kill_during_training(hook: str, world: int, steps: int, seed: int, *, comm_kwargs: Optional[Dict[str, Any]] = None,
                         victims: Optional[List[int]] = None, deaths: int = 1, **train_kwargs: Any) -> Dict[str, Any]:
    """kill -9 ``deaths`` random ranks (or ``victims``), each at a random step
    and moment; every survivor's report. ``deaths=0``: the same training
    without a death."""
    rng = random.Random(seed)
    if victims is None:
        victims = rng.sample(range(world), deaths)
    kills = {v: (rng.randrange(10, steps - 10), rng.randrange(3)) for v in victims}
    frozen = train_kwargs.get("freeze", False)
    res = _collect(world, _reporting(_ft_rank), hook, steps, kills, comm_kwargs or {}, train_kwargs,
                   dead=() if frozen else tuple(kills), frozen=tuple(kills) if frozen else ())
    res.update(kills=kills)
    return res


def _join_rank(rank: int, procs: int, port: int, hook: str, steps: int, victim: int, kill_step: int,
               path: Optional[str] = None) -> Dict[str, Any]:
    """Ranks 0..world-1 train; ``victim`` dies at ``kill_step``; process
    ``world`` (the replacement) joins once the survivors have shrunk."""
    import datetime

    import torch.distributed as dist

    world = procs - 1
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    if rank == world:
        store.wait(["ft-join/go"], datetime.timedelta(seconds=120))
        t0 = time.monotonic()
        comm = pycomm.elastic.join(store, "ft-join", timeout=60)
        joined_s = time.monotonic() - t0
    else:
        comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name="ft-join", timeout=20)
        joined_s = None

    def on_step(ft, step):
        # The survivors say "go" once they have shrunk; the replacement is
        # admitted at the next multiple of admit_every.
        if ft.comm.epoch == 1 and ft.rank == 0 and not store.check(["ft-join/go"]):
            store.set("ft-join/go", "1")

    out = train(comm, hook, steps, kill_at=(kill_step, 0) if rank == victim else None, on_step=on_step,
                admit_every=10, path=path)
    out.update(joined=comm.joined, joined_s=joined_s)
    return out


def replacement_joins(hook: str, world: int = 4, steps: int = 120, victim: int = 1,
                      kill_step: int = 23, path: Optional[str] = None) -> Dict[str, Any]:
    """A rank dies; the survivors go on; a replacement joins and is healed."""
    return _collect(world + 1, _reporting(_join_rank), hook, steps, victim, kill_step, path, dead=(victim,))


def _refill_rank(rank: int, procs: int, port: int, steps: int, victim: int, kill_step: int, spare: bool,
                 wait_s: float) -> Dict[str, Any]:
    """The job is bounded at its size both ways (min = max = world): with
    ``spare``, process ``world`` joins at once and waits as a spare; ``victim``
    dies at ``kill_step``. Reports the worlds every step attempt saw, or the
    error the wait ended in and how long after the failed attempt began."""
    import datetime

    import torch.distributed as dist

    world = procs - 1 if spare else procs
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    if spare and rank == world:
        comm = pycomm.elastic.join(store, "ft-min", timeout=120)
    else:
        comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name="ft-min", timeout=20)
    seen: Dict[int, int] = {}
    began = [0.0]

    def on_step(ft, step):
        seen[ft.world_size] = seen.get(ft.world_size, 0) + 1
        began[0] = time.monotonic()

    try:
        out = train(comm, "int8", steps, kill_at=(kill_step, 0) if rank == victim else None, on_step=on_step,
                    admit_every=10, max_world_size=world, min_world_size=world, min_world_timeout=wait_s)
    except pycomm.CommError as e:
        return dict(error=str(e), after_s=time.monotonic() - began[0], seen=seen)
    out.update(seen=seen, joined=comm.joined)
    return out


def below_min_world(world: int = 4, steps: int = 60, victim: int = 1, kill_step: int = 23, spare: bool = True,
                    wait_s: float = 2.0) -> Dict[str, Any]:
    """A job bounded at ``world`` ranks both ways loses ``victim``: with a
    spare standing by, it comes in before the next step; without, every
    survivor raises after ``wait_s``."""
    return _collect(world + int(spare), _reporting(_refill_rank), steps, victim, kill_step, spare, wait_s,
                    dead=(victim,))


def _orphan_rank(rank: int, procs: int, port: int) -> Dict[str, Any]:
    """Rank 0 trains alone and admits process 1, then dies in the heal that
    would hand the newcomer its state: the newcomer is the only survivor
    and holds nothing of the training but its own initialization."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        store.wait(["ft-orphan/go"], datetime.timedelta(seconds=60))
        comm = pycomm.elastic.join(store, "ft-orphan", timeout=60)
    else:
        comm = pycomm.Communicator(store=store, rank=0, world_size=1, name="ft-orphan", timeout=20)

    def on_step(ft, step):
        if step == 0:
            ft._heal = functools.partial(os._exit, 1)  # the member dies in the admission's heal
            store.set("ft-orphan/go", "1")
        time.sleep(0.05)  # the newcomer's ticket is in by the admission at step 5

    t0 = time.monotonic()
    try:
        out = train(comm, "allreduce", 20, on_step=on_step, admit_every=5)
    except pycomm.CommError as e:
        return dict(error=f"{type(e).__name__}: {e}", after_s=time.monotonic() - t0)
    return dict(trained=out["steps"], world=out["world"])


def newcomer_left_alone() -> Dict[str, Any]:
    """The only survivor is a newcomer not healed yet (see _orphan_rank)."""
    return _collect(2, _reporting(_orphan_rank), dead=(0,))


def api_checks() -> Dict[str, Any]:
    """Bad arguments and a state_dict round trip, on a one-rank communicator."""
    import torch.distributed as dist

    from hooks_cases import digits_mlp

    out: Dict[str, Any] = {}
    comm = pycomm.Communicator(store=dist.HashStore(), rank=0, world_size=1, name="ft-api")
    model = digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for key, kwargs in dict(on_failure=dict(on_failure="retry"), admit_every=dict(admit_every=-1),
                            max_world=dict(max_world_size=0), min_world=dict(min_world_size=5, max_world_size=4),
                            min_wait=dict(min_world_size=2, min_world_timeout=-1.0),
                            state=dict(state=object()), comm=dict(comm=object())).items():
        args = dict(comm=comm, **kwargs) if key != "comm" else kwargs
        try:
            FaultTolerantDDP(model, opt, **args)
            out[key] = "no error"
        except (TypeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    meta = digits_mlp().to("meta")
    try:
        FaultTolerantDDP(meta, torch.optim.SGD(meta.parameters(), lr=0.1), comm)
        out["device"] = "no error"
    except ValueError as e:
        out["device"] = str(e)
    try:
        FaultTolerantDDP(model, opt, comm, state=hooks.AllReduceState(path="group"), hook=hooks.allreduce_hook)
        FaultTolerantDDP(model, opt, comm, state=hooks.StaleState(path="ipc"), hook=hooks.stale_hook)
        out["ipc"] = "no error"
    except ValueError as e:
        out["ipc"] = str(e)
    # A state_dict round trip: a second wrapper loads the first's.
    xtr, ytr, _, _ = _digits()
    state = hooks.CompressionState(codec=pycomm.Int8(), start_iter=0)
    ft = FaultTolerantDDP(model, opt, comm, hook=hooks.int8_hook, state=state, bucket_cap_mb=0.03)
    for step in range(5):
        ft.step(lambda: torch.nn.functional.cross_entropy(ft(xtr[:32]), ytr[:32]).backward())
    saved = ft.state_dict()
    model2 = digits_mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    ft2 = FaultTolerantDDP(model2, opt2, comm, hook=hooks.int8_hook,
                           state=hooks.CompressionState(codec=pycomm.Int8(), start_iter=0), bucket_cap_mb=0.03)
    ft2.load_state_dict(saved)
    out["same_after_load"] = digest(ft2) == digest(ft) and ft2.steps_done == 5
    out["residuals_saved"] = sum(t is not None and bool(t.abs().sum() > 0) for t in saved["hook"]["worker_residuals"])
    comm.close()
    return out
