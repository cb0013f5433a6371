"""Pipeline x data-parallel training that survives failures
(pycomm.elastic.FaultTolerantPipeline), in ranks forked from a zygote
(reliability_cases): 2 replicas of a 2-rank pipeline (or 3), a rank killed
(or frozen; or several killed at once) at a random step and moment, a
replacement process that joins; the broken replica's survivor rejoins, and
with the replacement forms a new replica that is healed stage by stage (or
the survivors of broken replicas regroup into whole ones)."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import pycomm
from pycomm import elastic

WIDTH, BATCH, JOB = 16, 32, "pp"


def preload() -> None:
    """What every rank imports, once, in the process they fork from."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.set_num_threads(1)


def _data(steps: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps, BATCH, WIDTH, generator=g)
    w = torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5
    return x, torch.tanh(x @ w)


def _stage(i: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def digest(ft: elastic.FaultTolerantPipeline) -> str:
    """This rank's stages and optimizer state, bitwise."""
    h = hashlib.sha256()
    for p in ft.module.parameters():
        h.update(p.detach().numpy().tobytes())
        for k, v in sorted(ft.optimizer.state.get(p, {}).items()):
            h.update(v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def _rank(uid: int, world: int, port: int, conn, cfg: Dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(uid)  # every rank starts different: the first heal makes replicas equal
        if uid >= world:
            comm = elastic.join(store, JOB, timeout=60.0)
        else:
            comm = pycomm.Communicator(store=store, rank=uid, world_size=world, name=JOB, timeout=30.0,
                                       local_size=cfg.get("local_size"))
        comm.heartbeat_timeout = cfg.get("heartbeat", 1.0)
        x, y = _data(cfg["steps"])

        def batch(step: int, replica: int, replicas: int):
            return x[step].tensor_split(replicas)[replica], y[step].tensor_split(replicas)[replica]

        ft = elastic.FaultTolerantPipeline(
            _stage, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), comm, num_stages=cfg["stages"],
            num_microbatches=4, schedule=cfg["schedule"], loss_fn=nn.functional.mse_loss,
            admit_every=cfg.get("admit_every", 4), on_failure=cfg.get("on_failure", "redo"),
            min_world_size=cfg.get("min_world"))
        conn.send(("member", uid, None))
        rows: List[tuple] = []
        while ft.steps_done < cfg["steps"]:
            loss = ft.step(batch)
            rows.append((ft.steps_done, ft.stage, ft.comm.epoch, digest(ft), None if loss is None else float(loss)))
            if rows:
                conn.send(("steps", uid, rows))
                rows = []
            if ft.replicas < 2 and cfg["pace"]:
                # A shrunk job waits after each step (the step itself is timed
                # as recovery): the new replica is admitted only at a step
                # boundary, and on a loaded machine the rest of a toy run can
                # otherwise end before the newcomers are ready, which is not
                # what this run tests.
                time.sleep(cfg["pace"])
        ft.train(cfg["steps"], batch)
        conn.send(("steps", uid, rows))
        conn.send(("done", uid, dict(events=ft.events, replicas=ft.replicas, stage=ft.stage, rank=ft.rank,
                                     final=digest(ft))))
        ft.comm.close()
    except elastic.FencedOut as e:
        conn.send(("fenced", uid, str(e)))
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        conn.send(("crash", uid, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _trains(uid: int, completions: List[tuple]) -> bool:
    """Whether ``uid`` completed a step after the first change of membership
    (a member now; rows still in the pipe when the victim was hit are older)."""
    return any(u == uid and epoch > 0 for (_, u, epoch) in completions)


def train(schedule: str = "1f1b", *, steps: int = 24, failure: Optional[str] = "kill", victim: Optional[int] = None,
          seed: int = 0, local_size: Optional[int] = None, on_failure: str = "redo",
          replacement: bool = True, pace: float = 0.25, min_world: Optional[int] = None, world: int = 4,
          victims: Optional[List[int]] = None) -> Dict[str, Any]:
    """``world`` ranks (replicas of 2 stages; 4: 2 replicas) train ``steps``
    steps; with ``failure`` ("kill" or "freeze"), ``victim`` (default: a
    random rank; ``victims``: several at the same moment) is killed -9 /
    frozen at a random step and moment and (``replacement``) a new process
    joins; while only one replica trains, each of its steps is followed by
    ``pace`` seconds of sleep (``min_world``: the job's min_world_size
    instead). Returns what the driver saw: per (step, stage) the distinct
    digests, the losses, the processes' ends, recovery time."""
    import reliability_cases as rc
    from harness import free_port

    rng = random.Random(seed)
    cfg = dict(steps=steps, stages=2, schedule=schedule, local_size=local_size, on_failure=on_failure, pace=pace,
               min_world=min_world)
    port = free_port()
    store_pid, pids, conns = rc.fork_ranks(world, _rank, cfg, port=port)
    procs = {u: dict(pid=pids[u], conn=conns[u]) for u in range(world)}
    victims = list(victims) if victims is not None else [rng.randrange(world) if victim is None else victim]
    victim = victims[0]  # the one whose progress times the failure
    at_step = rng.randrange(3, steps // 3)  # time left to admit the replacement replica
    digests: Dict[tuple, set] = {}
    losses: Dict[int, List[float]] = {}
    ends: Dict[int, tuple] = {}
    t_fail, completions, continued = None, [], False
    deadline = time.monotonic() + 120
    while len(ends) < len(procs) and time.monotonic() < deadline:
        live = [p["conn"] for u, p in procs.items() if u not in ends]
        for c in mp.connection.wait(live, timeout=0.5):
            uid = next(u for u, p in procs.items() if p["conn"] is c)
            try:
                kind, _, payload = c.recv()
            except (EOFError, OSError):
                ends[uid] = ("vanished", None)
                continue
            if kind == "steps":
                for step, stage, epoch, dg, loss in payload:
                    digests.setdefault((step, stage), set()).add(dg)
                    completions.append((time.monotonic(), uid, epoch))
                    if loss is not None:
                        losses.setdefault(step, []).append(loss)
                if failure and t_fail is None and uid == victim and any(r[0] >= at_step for r in payload):
                    time.sleep(rng.uniform(0, 0.02))  # somewhere in a later step
                    for v in victims:
                        os.kill(procs[v]["pid"], signal.SIGKILL if failure == "kill" else signal.SIGSTOP)
                    t_fail = time.monotonic()
                    if failure == "kill":
                        ends.update((v, ("killed", None)) for v in victims)
                    if replacement:
                        parent, child = mp.Pipe(duplex=False)
                        procs[world] = dict(pid=rc._start_rank(_rank, world, world, port, child, (cfg,)),
                                            conn=parent)
                        child.close()
            elif kind in ("done", "fenced", "crash"):
                ends[uid] = (kind, payload)
        finished = [u for u, e in ends.items() if e[0] == "done"]
        if t_fail is not None and finished and all(u in ends or not _trains(u, completions) for u in procs):
            for u in procs:  # members are done: a process still waiting to be admitted never will be
                if u not in ends:
                    os.kill(procs[u]["pid"], signal.SIGKILL)
                    ends[u] = ("late-joiner", None)
        if failure == "freeze" and t_fail is not None and not continued and victim not in ends and \
                time.monotonic() > t_fail + 4:
            os.kill(procs[victim]["pid"], signal.SIGCONT)  # it finds itself fenced out and rejoins
            continued = True
    hung = rc.reap([p["pid"] for p in procs.values()], time.monotonic() + 10)
    rc.reap([store_pid], 0)
    # Recovery: the failure to the first step that every rank of the other
    # replicas (they stay members throughout) completed after the shrink.
    stayers = [u for u in range(world) if u // 2 not in {v // 2 for v in victims}]
    recovery = None
    if t_fail:
        firsts = [min((t for (t, u2, e) in completions if u2 == u and t > t_fail and e > 0), default=None)
                  for u in stayers]
        recovery = max(firsts) - t_fail if firsts and None not in firsts else None
    return dict(victim=victim, victims=victims, at_step=at_step, ends={u: e[0] for u, e in ends.items()},
                done={u: e[1] for u, e in ends.items() if e[0] == "done"},
                why={u: e[1] for u, e in ends.items() if e[0] in ("crash", "fenced")},
                split=sorted(k for k, v in digests.items() if len(v) > 1), steps_seen=len({k[0] for k in digests}),
                final_loss=sum(losses[steps]) / len(losses[steps]) if steps in losses else None,
                losses={s: sum(v) / len(v) for s, v in losses.items()}, recovery=recovery, hung=len(hung))


def _dies_before_its_sub_bootstraps(uid: int, world: int, port: int, conn) -> None:
    """4 ranks build the job's communicator; rank 3 dies right before it
    builds its pipeline's sub-communicators, so it never publishes anything
    in their keys. The others report how long the pipeline took to stand."""
    import datetime

    import torch.distributed as dist

    from pycomm.elastic import pipeline as ft_pipeline

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    comm = pycomm.Communicator(store=store, rank=uid, world_size=world, name=JOB, timeout=30.0)
    comm.heartbeat_timeout = 1.0
    if uid == world - 1:
        def dies(**kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        ft_pipeline.Communicator = dies
    t0 = time.monotonic()
    try:
        ft = elastic.FaultTolerantPipeline(
            _stage, lambda ps: torch.optim.SGD(ps, lr=0.1), comm, num_stages=2, num_microbatches=2,
            loss_fn=nn.functional.mse_loss, join_timeout=20.0)
        conn.send(dict(seconds=time.monotonic() - t0, replicas=ft.replicas,
                       events=[e["kind"] for e in ft.events]))
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        conn.send(dict(seconds=time.monotonic() - t0, error=f"{type(e).__name__}: {str(e)[:300]}"))


def dies_before_its_sub_bootstraps() -> Dict[str, Any]:
    """Ranks 0 and 1 (the replica that survives) report; rank 2, whose
    replica broke, waits to rejoin and is stopped with the rest."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(4, _dies_before_its_sub_bootstraps)
    reports = {r: (conns[r].recv() if conns[r].poll(90) else None) for r in (0, 1)}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return reports
