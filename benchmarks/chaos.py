"""A chaos soak of fault-tolerant training: ranks die (kill -9) or freeze
(SIGSTOP) at random moments, every few seconds, and a replacement starts for
each; the training must never stop, never diverge and never leak.

What runs: ``--world`` ranks train the digits MLP with
:class:`pycomm.elastic.FaultTolerantDDP` (int8 hook, ``--path`` communicator
or group) for ``--steps`` global steps (a global batch of 64 split over the
current world; SGD with momentum, cosine to zero). A driver process forks a
Store host (it outlives every rank), the ranks, and a replacement for each
rank that dies; replacements join through :func:`pycomm.elastic.join` and are
admitted every ``--admit-every`` steps, up to ``--max-world`` ranks (default
``--world``): a replacement for a frozen rank that its peers waited for
stands by as a spare until the next failure makes room.

The failures: every ``--gap`` seconds on average (uniform in [0.5, 1.5] of
it), or, one time in four, 0-0.3 s after the previous one (inside its shrink,
heal or a newcomer's join), a random live process (a member or a joiner) is
killed (kill -9) or, one time in four, frozen (SIGSTOP) (the verdict says
what each hit: "a step", "a join" (a newcomer) or "recovery" (within 0.5 s
of the previous failure)). A frozen one's peers find it by its heartbeat
(``--heartbeat`` s); continued, it must say that it was fenced out, or, if
its peers were waiting for it where no heartbeat is judged (on the Store, in
an admission), go on as a member; once it completes a step again (a pipeline
rank also after it rejoined) it is a member like any other, and may be hit
again. At least ``--min-world`` ranks stay alive; in PP x DP, a member is
hit only while another replica untouched since the job last settled holds
its stage (else the job would rightly end: that stage's state lost). One
kill in eight of a PP x DP member takes a member of another replica with it
at the same moment ("together": a host lost), where one may be hit: the
survivors of the two replicas regroup.

Checked: every step, every rank's parameters and optimizer state hashed
(sha256) and sent to the driver in batches: all ranks that completed step s
must agree bitwise; at the end: accuracy within 1 point of the same training
without failures (run after the soak, in the same invocation), nothing of
pycomm's left in /dev/shm, no process left running, and recovery (a failure
to the step that every survivor completed next) min / median / max.

When nothing happens for ``--stall-s`` seconds (no step, no process changing
state, before or after the last step) the driver asks every live rank for its
Python stacks and fails; on any failure of its own it kills every rank, so
a caller never waits on ranks it left behind.

About 700 lines: the two jobs (DDP, PP x DP) and the driver share one report
protocol and one verdict, which one file keeps in step.

Examples::

    python benchmarks/chaos.py --failures 10                    # CI's size
    PYCOMM_LONG=1 python benchmarks/chaos.py --failures 200 --world 8 --gap 1.5
"""
from __future__ import annotations

import argparse
import importlib
import io
import datetime
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import free_port  # noqa: E402

GLOBAL_BATCH = 64
JOB = "chaos"


def digest(ft: Any) -> str:
    """Parameters and optimizer state, bitwise."""
    h = hashlib.sha256()
    for p in ft.module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
        for k, v in sorted(ft.optimizer.state.get(p, {}).items()):
            h.update(k.encode())
            h.update(v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def step_shard(x: torch.Tensor, y: torch.Tensor, step: int, parts: int, part: int):
    """Part ``part`` of ``parts`` of step ``step``'s global batch: the same
    global batch whatever the world, so that a step's result does not
    depend on who was there."""
    idx = torch.randint(0, len(x), (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(1000 + step))
    mine = torch.tensor_split(idx, parts)[part]
    return x[mine], y[mine]


class Reporter:
    """What one process tells the driver: the rows of its completed steps,
    in batches, then its last word (done, fenced or crash). Each message
    also carries the membership changes its trainer recorded since the last
    one (``watch``), so that a rank killed later has told of them."""

    def __init__(self, uid: int, conn: Any) -> None:
        self.uid, self.conn, self.rows = uid, conn, []
        self.events: List[Dict[str, Any]] = []
        self.sent = 0

    def watch(self, events: List[Dict[str, Any]]) -> None:
        """The trainer's ``events`` list, read again at every message."""
        self.events, self.sent = events, 0

    def row(self, *row: Any) -> None:
        self.rows.append(row)
        if len(self.rows) >= 20 or len(self.events) > self.sent:
            self.flush()

    def flush(self, kind: str = "steps", **extra: Any) -> None:
        self.conn.send(dict(kind=kind, uid=self.uid, steps=self.rows, new_events=self.events[self.sent:], **extra))
        self.rows, self.sent = [], len(self.events)


def reporting(uid: int, conn: Any, body: Callable[[Reporter], None]) -> None:
    """Runs one process's ``body``; a fence or any failure is its last word."""
    from pycomm.elastic import FencedOut

    torch.set_num_threads(1)
    # The driver asks every live process for its Python stacks (on stderr)
    # before it gives up on a hang.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    report = Reporter(uid, conn)
    try:
        body(report)
    except FencedOut as e:
        report.flush("fenced", why=str(e).splitlines()[0])
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        report.flush("crash", why=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")


def connect(uid: int, world: int, port: int, args: argparse.Namespace, joining: bool) -> Any:
    """The job's communicator: a founding member's, or a replacement's
    admission, retried as an agent restarts a replacement whose admission
    failed (a member or another newcomer died while it was being built)."""
    import pycomm

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    if joining:
        for attempt in range(5):
            try:
                comm = pycomm.elastic.join(store, JOB, timeout=args.join_timeout)
                break
            except pycomm.CommError:
                if attempt == 4:
                    raise
    else:
        comm = pycomm.Communicator(store=store, rank=uid, world_size=world, name=JOB, timeout=30)
    comm.heartbeat_timeout = args.heartbeat
    return comm


def rank_main(uid: int, world: int, port: int, conn: Any, args: argparse.Namespace, joining: bool) -> None:
    """One process: train until ``args.steps`` steps are done, sending the
    driver (step, digest, time, world) of every completed step in batches."""
    reporting(uid, conn, lambda report: _ddp_job(uid, world, port, report, args, joining))


def _ddp_job(uid: int, world: int, port: int, report: Reporter, args: argparse.Namespace, joining: bool) -> None:
    import pycomm
    from pycomm import hooks
    from pycomm.elastic import FaultTolerantDDP

    from hooks_cases import _digits, digits_mlp

    # Everything a replacement needs before it joins (data, model), as a
    # restarted worker would: the members wait for it from its admission
    # until its first heal.
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(uid)  # every rank differs: the wrapper's heal makes them equal
    model = digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    comm = connect(uid, world, port, args, joining)
    state = hooks.CompressionState(codec=pycomm.Int8(), start_iter=5, path=args.path)
    ft = FaultTolerantDDP(model, opt, comm, hook=hooks.int8_hook, state=state, scheduler=sched,
                          admit_every=args.admit_every, max_world_size=args.max_world or None, bucket_cap_mb=0.03)
    report.watch(ft.events)
    report.flush("member", joined=comm.joined)

    def step_fn(step: int) -> None:
        x, y = step_shard(xtr, ytr, step, ft.world_size, ft.rank)
        torch.nn.functional.cross_entropy(ft(x), y).backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)

    while ft.steps_done < args.steps:
        ft.step(lambda: step_fn(ft.steps_done))
        report.row(ft.steps_done, digest(ft), time.monotonic(), ft.world_size, ft.comm.epoch)
    ft.train(args.steps, step_fn)  # every rank agrees that all steps are done
    with torch.no_grad():
        acc = (ft.module(xte).argmax(1) == yte).float().mean().item() * 100
    report.flush("done", acc=acc, world=ft.world_size)
    ft.comm.close()


def _digits_stage(i: int) -> torch.nn.Module:
    """Stage ``i`` of the digits MLP cut in two (64 -> 128 -> 128 | -> 10)."""
    from torch import nn

    if i == 0:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
    return nn.Sequential(nn.Linear(128, 10))


def pipeline_main(uid: int, world: int, port: int, conn: Any, args: argparse.Namespace, joining: bool) -> None:
    """One process of the PP x DP job: replicas of a 2-stage pipeline
    (FaultTolerantPipeline); the rows carry the stage and replica, and the "done"
    report this rank's stage state (the driver assembles the model)."""
    reporting(uid, conn, lambda report: _pipeline_job(uid, world, port, report, args, joining))


def _pipeline_job(uid: int, world: int, port: int, report: Reporter, args: argparse.Namespace,
                  joining: bool) -> None:
    from pycomm.elastic import FaultTolerantPipeline

    from hooks_cases import _digits

    xtr, ytr, _, _ = _digits()
    torch.manual_seed(uid)
    comm = connect(uid, world, port, args, joining)
    ft = FaultTolerantPipeline(
        _digits_stage, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), comm, num_stages=2,
        num_microbatches=4, schedule=args.schedule, loss_fn=torch.nn.functional.cross_entropy,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps),
        admit_every=args.admit_every, max_world_size=args.max_world or None, join_timeout=args.join_timeout)
    report.watch(ft.events)
    report.flush("member", joined=comm.joined)

    def shard(step: int, replica: int, replicas: int):
        return step_shard(xtr, ytr, step, replicas, replica)

    while ft.steps_done < args.steps:
        ft.step(shard)
        report.row(ft.steps_done, digest(ft), time.monotonic(), ft.comm.world_size, ft.comm.epoch, ft.stage,
                   ft.replica)
    ft.train(args.steps, shard)
    state = io.BytesIO()  # bytes: a tensor sent through a pipe would travel as a file descriptor
    torch.save(ft.module.state_dict(), state)
    report.flush("done", world=ft.comm.world_size, stage=ft.stage, state=state.getvalue())
    ft.comm.close()


def membership_changes(member_events: Dict[int, List[Dict[str, Any]]]) -> Dict[str, int]:
    """The job's membership changes, from every rank's events: each change
    once (its members each record it, with the epoch it led to), by kind,
    and the shrinks that regrouped survivors of broken pipeline replicas."""
    changes: Dict[Tuple[str, int], int] = {}
    for events in member_events.values():
        for e in events:
            key = (e["kind"], e["epoch"])
            changes[key] = max(changes.get(key, 0), int(e.get("regrouped", 0)))
    out = {kind: sum(k == kind for k, _ in changes) for kind in ("shrink", "admit", "rejoin")}
    out["regrouping_shrinks"] = sum(1 for (k, _), r in changes.items() if k == "shrink" and r)
    out["regrouped_replicas"] = sum(r for (k, _), r in changes.items() if k == "shrink")
    return out


def pipeline_accuracy(reports: Dict[int, Dict[str, Any]]) -> List[float]:
    """The digits test accuracy of the model the "done" reports' stages make
    (one per replica of each stage: they are bitwise equal)."""
    from hooks_cases import _digits

    _, _, xte, yte = _digits()
    stages = {}
    for r in reports.values():
        stages.setdefault(r["stage"], torch.load(io.BytesIO(r["state"]), weights_only=True))
    if sorted(stages) != [0, 1]:
        return []
    model = torch.nn.Sequential(_digits_stage(0), _digits_stage(1))
    model[0].load_state_dict(stages[0])
    model[1].load_state_dict(stages[1])
    with torch.no_grad():
        return [(model(xte).argmax(1) == yte).float().mean().item() * 100]


class Soak:
    """The driver's view: processes, their pipes, what they reported."""

    def __init__(self, args: argparse.Namespace, failures: int, seed: int) -> None:
        self.args, self.failures, self.rng = args, failures, random.Random(seed)
        self.port = free_port()
        self.procs: Dict[int, Dict[str, Any]] = {}  # uid -> pid, conn, state
        self.digests: Dict[tuple, Dict[str, List[int]]] = {}  # (step, stage) -> digest -> uids
        self.completions: List[tuple] = []  # (time, uid, step, world)
        self.events: List[Dict[str, Any]] = []  # the failures injected
        self.reports: Dict[int, Dict[str, Any]] = {}
        # Each process's membership changes as it told of them (the dead's too).
        self.member_events: Dict[int, List[Dict[str, Any]]] = {}
        self.max_step = 0
        self.first_done = 0.0
        self.last_done: Dict[int, tuple] = {}  # uid -> (time, stage, replica) of its latest completed step
        # (PP x DP) Each member's (stage, replica) when the job last settled,
        # and the processes hit since (see pipeline_victims).
        self.picture: Dict[int, tuple] = {}
        self.hit_since: set = set()

    # ---------------------------------------------------------- processes

    def start_store(self) -> None:
        self.store_pid = os.fork()
        if self.store_pid == 0:
            try:
                s = dist.TCPStore("127.0.0.1", self.port, self.args.world, is_master=True, wait_for_workers=False)
                while s is not None:
                    time.sleep(3600)
            finally:
                os._exit(0)

    def start(self, uid: int, joining: bool) -> None:
        parent, child = mp.Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                parent.close()
                main = pipeline_main if self.args.job == "pipeline" else rank_main
                main(uid, self.args.world, self.port, child, self.args, joining)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        child.close()
        self.procs[uid] = dict(pid=pid, conn=parent, state="joining" if joining else "starting", t0=time.monotonic())

    def poll(self, timeout: float = 0.0) -> None:
        """Read what the processes sent."""
        conns = [p["conn"] for p in self.procs.values() if p["conn"] is not None]
        for c in mp.connection.wait(conns, timeout):
            uid = next(u for u, p in self.procs.items() if p["conn"] is c)
            try:
                msg = c.recv()
            except (EOFError, OSError):
                self.procs[uid]["conn"] = None
                # (Not one the driver ended itself: a late joiner, or one stuck.)
                if self.procs[uid]["state"] not in ("dead", "done", "fenced", "crash", "late-joiner", "stuck"):
                    self.procs[uid]["state"] = "vanished"
                continue
            p = self.procs[uid]
            for step, dg, t, world, _epoch, *stage in msg["steps"]:
                if p["state"] == "continued" and t > p["continued_at"]:
                    # A frozen process back as a member (waited for, or a
                    # pipeline rank that rejoined): a member again. (One
                    # that only finishes the step it was frozen in is
                    # fenced at its next: the verdict goes by its end.)
                    p["state"], p["back"] = "member", True
                self.digests.setdefault((step, stage[0] if stage else 0), {}).setdefault(dg, []).append(uid)
                self.completions.append((t, uid, step, world))
                self.last_done[uid] = (t, *stage)
                self.max_step = max(self.max_step, step)
            self.member_events.setdefault(uid, []).extend(msg.get("new_events", []))
            kind = msg["kind"]
            if kind == "member":
                self.procs[uid]["state"] = "member"
            elif kind in ("done", "fenced", "crash"):
                self.procs[uid]["state"] = kind
                self.reports[uid] = msg

    def recovered(self, t: float, running: List[int], frozen: Dict[int, float]) -> bool:
        """Whether the failure at ``t`` is behind the training: no process
        waits to be admitted and every live member completed a step since."""
        if any(self.procs[u]["state"] in ("joining", "starting") for u in running):
            return False
        return self.completed_since(t, [u for u in running if self.procs[u]["state"] == "member" and u not in frozen])

    def completed_since(self, t: float, uids: List[int]) -> bool:
        """Whether each of ``uids`` completed a step after time ``t``."""
        return all(self.last_done.get(u, (-1.0,))[0] > t for u in uids)

    def pipeline_victims(self, live: List[int], members: List[int]) -> List[int]:
        """(PP x DP) Who of ``live`` may be hit without taking the last copy
        of a stage's state with it (the job could not go on, rightly):
        newcomers always; a member only while another replica that no
        failure touched since the job last settled holds its stage (that
        replica is whole, and stays whole through the survivors' regroup).
        Settled: every member completed a step since the last failure, so
        each one's stage and replica are known and no survivor waits to
        rejoin. (The last completed step's world did not say it: a member
        frozen, or killed milliseconds ago, still counted.)"""
        t = self.events[-1]["t"] if self.events else 0.0
        if members and self.completed_since(t, members):
            self.picture = {u: self.last_done[u][1:] for u in members}
            self.hit_since = set()
        broken = {self.picture[v][1] for v in self.hit_since if v in self.picture}

        def spared(v: int) -> bool:
            if v not in self.picture or v in self.hit_since:
                return False
            stage, replica = self.picture[v]
            return any(st == stage and rep != replica and rep not in broken
                       for u, (st, rep) in self.picture.items() if u not in self.hit_since)
        return [u for u in live if self.procs[u]["state"] == "joining" or spared(u)]

    def hit(self, victim: int, freeze: bool, frozen: Dict[int, float], during: str = "") -> None:
        """Kill -9 ``victim`` (or freeze it, until ``frozen`` says), record
        it, and start its replacement."""
        t = time.monotonic()
        os.kill(self.procs[victim]["pid"], signal.SIGSTOP if freeze else signal.SIGKILL)
        self.hit_since.add(victim)
        if not during:
            recent = bool(self.events) and t - self.events[-1]["t"] < 0.5
            during = "recovery" if recent else "a join" if self.procs[victim]["state"] == "joining" else "a step"
        # The pid: the ranks' failure messages name the dead by it.
        self.events.append(dict(t=t, uid=victim, pid=self.procs[victim]["pid"], kind="freeze" if freeze else "kill",
                                during=during, step=self.max_step))
        if freeze:
            frozen[victim] = t + self.args.heartbeat + 2.0
            self.procs[victim]["state"] = "frozen"
        else:
            self.procs[victim]["state"] = "dead"
        self.start(self.next_uid, joining=True)  # its replacement
        self.next_uid += 1

    def alive(self) -> List[int]:
        # "continued": a frozen process woken up, until it reports how it
        # ended (fenced out, or done as a member its peers had waited for).
        return [u for u, p in self.procs.items() if p["state"] in ("member", "joining", "starting", "continued")]

    # ---------------------------------------------------------- the soak

    def run(self) -> Dict[str, Any]:
        try:
            return self._run()
        except BaseException:
            # Never leave a process behind: one still holding the caller's
            # pipes keeps a test waiting on them until its own timeout.
            for p in self.procs.values():
                try:
                    os.kill(p["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if getattr(self, "store_pid", None):
                try:
                    os.kill(self.store_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise

    def _run(self) -> Dict[str, Any]:
        args = self.args
        before = {f for f in os.listdir("/dev/shm") if f.startswith("pycomm.")}
        self.start_store()
        for r in range(args.world):
            self.start(r, joining=False)
        self.next_uid = args.world
        injected = 0
        next_at = None
        frozen: Dict[int, float] = {}  # uid -> when to continue it
        last = time.monotonic()
        # Anything at all happening: a step, or a process changing state.
        seen, last_change = None, last
        while True:
            self.poll(0.02)
            now = time.monotonic()
            states = [p["state"] for p in self.procs.values()]
            if (states, self.max_step) != seen:
                seen, last_change = (states, self.max_step), now
            running = [u for u in self.alive()]
            if not running and not frozen:
                break
            # Continue frozen processes once their peers have surely moved on.
            for uid, when in list(frozen.items()):
                if now >= when:
                    os.kill(self.procs[uid]["pid"], signal.SIGCONT)
                    del frozen[uid]
                    if self.procs[uid]["state"] == "frozen":
                        self.procs[uid].update(state="continued", continued_at=now)
            members = [u for u in running if self.procs[u]["state"] == "member"]
            if injected == 0 and next_at is None and len(members) == args.world:
                next_at = now + args.gap  # the first failure once everyone trains
            near_end = self.max_step >= args.steps - 4 * max(1, args.admit_every)
            if args.calm and self.events and not self.recovered(self.events[-1]["t"], running, frozen):
                next_at = max(next_at or now, now + 0.05)
            if next_at is not None and now >= next_at and injected < self.failures and not near_end:
                # (Not a frozen process woken up, until it is back as a member:
                # how it ends is what it is checked on.)
                live = [u for u in running if u not in frozen and self.procs[u]["state"] != "continued"
                        and (not args.calm or self.procs[u]["state"] == "member")]
                if args.job == "pipeline":
                    live = self.pipeline_victims(live, members)
                if not live:
                    # Nobody to hit yet (a pipeline's replacement replica is
                    # not in, and no newcomer is on its way): look again soon.
                    next_at = now + 0.05
                else:
                    standing = len(members) - sum(1 for u in members if u in frozen)
                    if standing > args.min_world:
                        victim = self.rng.choice(live)
                        freeze = self.rng.random() < 0.25 and self.procs[victim]["state"] == "member"
                        was_member = self.procs[victim]["state"] == "member"
                        self.hit(victim, freeze, frozen)
                        injected += 1
                        if (args.job == "pipeline" and was_member and not freeze and injected < self.failures
                                and standing - 1 > args.min_world and self.rng.random() < 0.125):
                            # A host lost: a member of another replica dies at
                            # the same moment, and the survivors regroup.
                            mine = self.picture.get(victim, (None, None))[1]
                            others = [u for u in self.pipeline_victims(live, members) if u != victim
                                      and self.procs[u]["state"] == "member" and self.picture[u][1] != mine]
                            if others:
                                self.hit(self.rng.choice(others), False, frozen, during="together")
                                injected += 1
                    last = now
                    quick = self.rng.random() < 0.25 and not args.calm
                    next_at = now + (self.rng.uniform(0.0, 0.3) if quick else self.rng.uniform(0.5, 1.5) * args.gap)
            if any(s == "done" for s in states):
                # The others are done: a pipeline's broken-replica survivor
                # that rejoined (a member to us) may wait for a partner that
                # never comes; anything else still running is stuck.
                self.first_done = self.first_done or now
                if now - self.first_done > 20:
                    for u in running:
                        os.kill(self.procs[u]["pid"], signal.SIGKILL)
                        late = args.job == "pipeline" or self.procs[u]["state"] == "joining"
                        self.procs[u]["state"] = "late-joiner" if late else "stuck"
            if any(s == "done" for s in states) and all(self.procs[u]["state"] != "member" for u in running):
                # Members finished: joiners still waiting will never be admitted.
                for u in running:
                    if self.procs[u]["state"] == "joining":
                        os.kill(self.procs[u]["pid"], signal.SIGKILL)
                        self.procs[u]["state"] = "late-joiner"
            # A hang: no step for stall_s while steps remain, or nothing at
            # all (after the last step too: processes that never finish).
            stalled = now - last > args.stall_s and self.max_step < args.steps
            if stalled or now - last_change > args.stall_s:
                self.dump_stacks(running)
                crashes = {u: r.get("why", "")[:800] for u, r in self.reports.items() if r.get("kind") == "crash"}
                raise RuntimeError(f"{'no step completed' if stalled else 'nothing happened'} for {args.stall_s} s "
                                   f"(a hang?) at step {self.max_step} of {args.steps}; states: "
                                   f"{ {u: p['state'] for u, p in self.procs.items()} }; crashes: {crashes}")
            if self.completions and self.completions[-1][0] > last:
                last = self.completions[-1][0]
        hung = self.reap() + [self.procs[u]["pid"] for u in self.procs if self.procs[u]["state"] == "stuck"]
        os.kill(self.store_pid, signal.SIGKILL)
        os.waitpid(self.store_pid, 0)
        leaked = sorted({f for f in os.listdir("/dev/shm") if f.startswith("pycomm.")} - before)
        return self.verdict(injected, hung, leaked)

    def dump_stacks(self, uids: List[int]) -> None:
        """Every live process's Python stacks, on stderr (faulthandler)."""
        for u in uids:
            try:
                os.kill(self.procs[u]["pid"], signal.SIGCONT)
                os.kill(self.procs[u]["pid"], signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(2.0)

    def reap(self) -> List[int]:
        hung = []
        deadline = time.monotonic() + 20
        for uid, p in self.procs.items():
            while True:
                done, _ = os.waitpid(p["pid"], os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    hung.append(uid)
                    os.kill(p["pid"], signal.SIGKILL)
                    os.waitpid(p["pid"], 0)
                    break
                time.sleep(0.05)
        return hung

    def verdict(self, injected: int, hung: List[int], leaked: List[str]) -> Dict[str, Any]:
        wrong = {s: d for s, d in self.digests.items() if len(d) > 1}
        done = {u: r for u, r in self.reports.items() if r["kind"] == "done"}
        crashes = {u: r["why"] for u, r in self.reports.items() if r["kind"] == "crash"}
        # A frozen process, once continued, is fenced out if its peers found
        # it silent; if they were waiting for it elsewhere (on the Store, in
        # an admission) it simply goes on as a member (and may be hit again
        # as one: "back"). Either is right.
        frozen = [e["uid"] for e in self.events if e["kind"] == "freeze"]
        fenced = [u for u in frozen if self.reports.get(u, {}).get("kind") == "fenced"]
        # (A pipeline's frozen rank, fenced out, rejoins: admitted, or still
        # waiting for a partner at the end.)
        ok_ends = ("fenced", "done") + (("late-joiner",) if self.args.job == "pipeline" else ())
        not_fenced = [u for u in frozen if self.reports.get(u, {}).get("kind", self.procs[u]["state"]) not in ok_ends
                      and not self.procs[u].get("back")]
        recoveries = []
        for e in self.events:
            # The ranks that trained before the failure and after it (not the
            # victim, not a newcomer): each one's next completed step.
            before = {u for (t, u, _, _) in self.completions if t < e["t"]}
            after = {u for (t, u, _, _) in self.completions if t > e["t"]}
            firsts = [min(t for (t, u2, _, _) in self.completions if u2 == u and t > e["t"])
                      for u in (before & after) - {e["uid"]}]
            if firsts:
                recoveries.append(max(firsts) - e["t"])
                e["recovery_s"] = recoveries[-1]
        accs = ([round(a, 4) for a in pipeline_accuracy(done)] if self.args.job == "pipeline" else
                sorted({round(r["acc"], 4) for r in done.values()}))
        return dict(failures=injected, kills=sum(e["kind"] == "kill" for e in self.events),
                    freezes=len(frozen), fenced=len(fenced),
                    back=sum(bool(self.procs[u].get("back")) and u not in fenced for u in frozen),
                    steps=max(s for s, _ in self.digests) if self.digests else 0,
                    checked_steps=len({s for s, _ in self.digests}), wrong_steps=len({s for s, _ in wrong}),
                    wrong={str(k): v for k, v in list(wrong.items())[:3]},
                    finished=sorted(done), acc=accs, crashes=crashes, not_fenced=not_fenced, hung=hung,
                    leaked=leaked, recoveries=recoveries, events=self.events,
                    during=sorted({e["during"] for e in self.events}),
                    late_joiners=[u for u, p in self.procs.items() if p["state"] == "late-joiner"],
                    # What every rank saw, the ones that died later too: each membership change
                    # (kind, step, world, epoch, seconds, cause), for telling where a long recovery went.
                    member_events={u: ev for u, ev in self.member_events.items() if ev},
                    changes=membership_changes(self.member_events),
                    frozen_ends={u: ("back as a member, then " if self.procs[u].get("back") else "")
                                 + self.reports.get(u, {}).get("kind", self.procs[u]["state"]) for u in frozen})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--failures", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--min-world", type=int, default=2, help="never fewer live members than this")
    ap.add_argument("--steps", type=int, default=None, help="default: enough for --failures at --gap")
    ap.add_argument("--gap", type=float, default=1.0, help="mean seconds between failures")
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--admit-every", type=int, default=5)
    ap.add_argument("--join-timeout", type=float, default=120.0)
    ap.add_argument("--max-world", type=int, default=None,
                    help="the job's max_world_size (default: --world; 0: no bound). A replacement for a frozen rank "
                         "that came back before its peers gave up on it waits as a spare instead of growing the job")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'compute' added to every step")
    ap.add_argument("--path", choices=("communicator", "group"), default="communicator")
    ap.add_argument("--job", choices=("ddp", "pipeline"), default="ddp",
                    help="DDP with the int8 hook, or PP x DP: replicas of a 2-stage pipeline (FaultTolerantPipeline)")
    ap.add_argument("--schedule", default="1f1b", help="the pipeline's schedule (--job pipeline)")
    ap.add_argument("--calm", action="store_true",
                    help="the next failure only once the last one is recovered from and its replacement admitted, "
                         "members only (no failure inside a shrink, heal or join)")
    ap.add_argument("--stall-s", type=float, default=60.0, help="fail if no step completes for this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the verdict here")
    args = ap.parse_args()
    if args.job == "pipeline" and args.world % 2:
        ap.error("--job pipeline runs 2-stage pipelines: --world must be even")
    if args.max_world is None:
        args.max_world = args.world
    if args.steps is None:
        # ~1 ms a step per rank on 2 cores (4 ms with 4 ranks, 9 with 8);
        # each failure takes its gap, ~0.5 s more for the recovery and the
        # replacement's admission (the failures wait while fewer than
        # --min-world + 1 members train), and --calm ~1 s more (the next
        # failure once the last was recovered from).
        per_step = 0.001 * args.world
        args.steps = max(300, int(args.failures * (args.gap + 0.5 + (1.0 if args.calm else 0.0)) / per_step))
    # The ranks are forked from here: their imports once, here, so that a
    # replacement starts within a fraction of a second, like a warm standby
    # (else ~2 s of imports on 2 busy cores, during which the failures wait:
    # see --min-world).
    for module in ("pycomm.elastic", "pycomm.hooks"):
        importlib.import_module(module)
    from hooks_cases import _digits, digits_mlp
    _digits()
    # The first optimizer and scheduler import more of torch (~2 s here).
    torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(digits_mlp().parameters(), lr=0.1), 10)
    # The soak first: the training without failures is only its accuracy's
    # yardstick, not needed when the soak cannot finish (it raises, saying
    # what it saw).
    t0 = time.monotonic()
    res = Soak(args, args.failures, args.seed).run()
    t_soak = time.monotonic() - t0
    t0 = time.monotonic()
    base = Soak(args, 0, args.seed).run()
    t_base = time.monotonic() - t0

    def spread(kind: str) -> str:
        rec = sorted(e["recovery_s"] for e in res["events"] if e["kind"] == kind and "recovery_s" in e)
        if not rec:
            return f"{kind}: none measured"
        return (f"{kind} min {rec[0] * 1e3:.0f} / median {statistics.median(rec) * 1e3:.0f} / max "
                f"{rec[-1] * 1e3:.0f} ms ({len(rec)})")
    ok = (res["failures"] == args.failures and res["wrong_steps"] == 0 and not res["crashes"] and not res["hung"]
          and not res["leaked"] and not res["not_fenced"] and res["finished"] and base["acc"]
          and len(res["acc"]) == 1 and res["acc"][0] >= base["acc"][0] - 1.0)
    what = (f"PP x DP, {args.world // 2} replicas of a 2-stage {args.schedule} pipeline" if args.job == "pipeline"
            else f"{args.path} path, int8 hook, world {args.world}")
    print(f"chaos soak ({what}, {args.steps} steps, seed {args.seed}): "
          f"{res['failures']} failures ({res['kills']} kill -9, {res['freezes']} SIGSTOP; hit while "
          f"{', '.join(res['during'])}) in {t_soak:.0f} s; {res['checked_steps']} steps checked, {res['wrong_steps']} "
          f"wrong; accuracy {res['acc']} vs {base['acc']} without failures ({t_base:.0f} s); "
          f"crashes {len(res['crashes'])}, hung {len(res['hung'])}, leaked {len(res['leaked'])}; frozen: "
          f"{res['fenced']} fenced out, {res['freezes'] - res['fenced'] - len(res['not_fenced'])} waited for, "
          f"{len(res['not_fenced'])} neither, {res['back']} back as members; joiners not admitted before the end "
          f"{len(res['late_joiners'])}; membership changes: {res['changes']['shrink']} shrinks"
          + (f" ({res['changes']['regrouping_shrinks']} regrouped survivors of broken replicas into "
             f"{res['changes']['regrouped_replicas']})" if args.job == "pipeline" else "")
          + f", {res['changes']['admit']} admissions, {res['changes']['rejoin']} rejoins; "
          f"failure to the next step every survivor completed: {spread('kill')}; {spread('freeze')} (found by the "
          f"{args.heartbeat:g} s heartbeat)", flush=True)
    for uid, why in list(res["crashes"].items())[:3]:
        print(f"  process {uid} crashed: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), base=base, soak=res, ok=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
