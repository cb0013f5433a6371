"""Scenarios of shrinking communicators (pycomm.elastic), run in harness
workers or in ranks forked from a zygote (reliability_cases)."""
from __future__ import annotations

import os
import random
import signal
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import pycomm
from pycomm import elastic
from harness import make_comm


def _sum_check(comm, ranks: List[int], n: int = 70001) -> bool:
    """An all-reduce whose closed-form result depends on which old ranks are members."""
    x = torch.full((n,), float(ranks[comm.rank] + 1))
    comm.all_reduce(x)
    return bool((x == sum(r + 1 for r in ranks)).all())


def exclude_on_purpose(rank: int, world: int, name: str, exclude: List[int]) -> Dict[str, Any]:
    comm = make_comm(rank, world, name, timeout=20)
    assert _sum_check(comm, list(range(world)))
    out: Dict[str, Any] = {}
    try:
        new = elastic.shrink(comm, exclude=exclude)
    except pycomm.CommError as e:
        out["error"] = str(e)
    else:
        out.update(world=new.world_size, rank=new.rank, epoch=new.epoch, members=new.parent_ranks,
                   ok=all(_sum_check(new, new.parent_ranks) for _ in range(3)))
        new.close()
    # The old communicator is fenced on every rank.
    try:
        comm.all_reduce(torch.ones(4))
        out["old"] = "no error"
    except pycomm.CommError as e:
        out["old"] = str(e)
    return out


def _victim_rank(rank: int, world: int, port: int, conn, steps_after: int, comm_kwargs: Dict[str, Any]) -> None:
    import reliability_cases as rc

    store, comm = rc._bootstrap(rank, world, port, "shrink", 5.0, **comm_kwargs)
    conn.send("ready")
    members = list(range(world))
    report: Dict[str, Any] = dict(wrong=0, shrinks=0)
    done_after = 0
    t_fail = None
    while done_after < steps_after:
        try:
            if not _sum_check(comm, members):
                report["wrong"] += 1
            if t_fail is not None and "recovery_s" not in report:
                report["recovered_at"] = time.monotonic()
                report["recovery_s"] = report["recovered_at"] - t_fail
            if report["shrinks"]:
                done_after += 1
        except pycomm.CommError as e:
            t_fail = time.monotonic()
            report["error"] = str(e)[:300]
            comm = elastic.shrink(comm)
            members = [members[r] for r in comm.parent_ranks]
            report["shrinks"] += 1
    report.update(members=members, world=comm.world_size, epoch=comm.epoch)
    comm.close()
    conn.send(report)


def _victim_rank_reporting(rank: int, world: int, port: int, conn, *args: Any) -> None:
    import traceback

    try:
        _victim_rank(rank, world, port, conn, *args)
    except BaseException as e:  # noqa: BLE001 - the test shows what went wrong
        conn.send(dict(crash=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


def kill_and_shrink(world: int, seed: int, steps_after: int = 20, comm_kwargs: Optional[Dict[str, Any]] = None,
                    victim: Optional[int] = None) -> Dict[str, Any]:
    """kill -9 a random rank of a stream of checked all-reduces; the
    survivors shrink and go on. Returns each survivor's report, hung ranks
    and what stayed in /dev/shm."""
    import reliability_cases as rc

    rng = random.Random(seed)
    victim = rng.randrange(world) if victim is None else victim
    before = rc.shm_entries()
    store_pid, pids, conns = rc.fork_ranks(world, _victim_rank_reporting, steps_after, comm_kwargs or {})
    for c in conns:
        if not c.poll(rc.START_S) or c.recv() != "ready":
            rc.reap(pids + [store_pid], 0)
            raise AssertionError("a rank did not start")
    time.sleep(rng.uniform(0.05, 0.3))
    t_kill = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    reports = {}
    for r, c in enumerate(conns):
        if r != victim:
            reports[r] = c.recv() if c.poll(60) else None
            if reports[r] and "recovered_at" in reports[r]:
                # Forked processes share CLOCK_MONOTONIC: from the kill to this
                # rank's first completed step on the shrunk communicator.
                reports[r]["since_kill_s"] = reports[r]["recovered_at"] - t_kill
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return dict(victim=victim, reports=reports, hung=len(hung), leaked=sorted(rc.shm_entries() - before))


def _store_dies_rank(rank: int, world: int, port: int, conn) -> None:
    import reliability_cases as rc

    store, comm = rc._bootstrap(rank, world, port, "storedies", 5.0)
    conn.send("ready")
    conn.recv()  # the store is gone now
    try:
        elastic.shrink(comm, exclude=[world - 1], grace=0.5)
        conn.send("no error")
    except Exception as e:  # noqa: BLE001
        conn.send(f"{type(e).__name__}: {e}")


def store_dies(world: int = 2) -> List[str]:
    """The Store's host dies: shrink says so on every rank."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(world, _store_dies_rank, duplex=True)
    for c in conns:
        assert c.poll(rc.START_S) and c.recv() == "ready"
    os.kill(store_pid, signal.SIGKILL)
    os.waitpid(store_pid, 0)
    for c in conns:
        c.send("go")
    out = [c.recv() if c.poll(60) else "no answer" for c in conns]
    rc.reap(pids, time.monotonic() + 10)
    return out


def _frozen_rank(rank: int, world: int, port: int, conn, heartbeat: float, comm_kwargs: Dict[str, Any]) -> None:
    import reliability_cases as rc

    store, comm = rc._bootstrap(rank, world, port, "frozen", 60.0, **comm_kwargs)
    comm.heartbeat_timeout = heartbeat
    conn.send("ready")
    members = list(range(world))
    report: Dict[str, Any] = dict(wrong=0)
    steps_after = 0
    try:
        while steps_after < 10:
            try:
                if not _sum_check(comm, members):
                    report["wrong"] += 1
                if comm.epoch:
                    steps_after += 1
                    if "recovered_at" not in report:
                        report["recovered_at"] = time.monotonic()
            except pycomm.CommError as e:
                report.update(error=str(e)[:400], failed_at=time.monotonic(),
                              blamed=getattr(e, "blamed_rank", None), failure=getattr(e, "failure", None))
                comm = elastic.shrink(comm)
                members = [members[r] for r in comm.parent_ranks]
        report.update(members=members, epoch=comm.epoch, heartbeat=comm.heartbeat_timeout)
    except pycomm.CommError as e:  # the frozen rank, once continued
        report["fenced"] = str(e)[:400]
    conn.send(report)


def freeze_and_shrink(world: int = 3, heartbeat: float = 1.0,
                      comm_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """SIGSTOP the last rank mid-stream: the others declare it failed within
    the heartbeat bound, shrink and go on; SIGCONT it: it is fenced out.
    ``comm_kwargs=dict(local_size=2)`` puts it on the second of two
    simulated hosts: ranks of the first host find it through the store."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(world, _frozen_rank, heartbeat, comm_kwargs or {})
    for c in conns:
        if not c.poll(rc.START_S) or c.recv() != "ready":
            rc.reap(pids + [store_pid], 0)
            raise AssertionError("a rank did not start")
    time.sleep(0.2)
    frozen = world - 1
    t_stop = time.monotonic()
    os.kill(pids[frozen], signal.SIGSTOP)
    reports = {r: (c.recv() if c.poll(60) else None) for r, c in enumerate(conns) if r != frozen}
    os.kill(pids[frozen], signal.SIGCONT)
    reports[frozen] = conns[frozen].recv() if conns[frozen].poll(60) else None
    for r, rep in reports.items():
        if rep and "failed_at" in rep:
            rep["detected_after_s"] = rep["failed_at"] - t_stop
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return dict(frozen=frozen, reports=reports, hung=len(hung))


def _busy_rank(rank: int, world: int, port: int, conn, heartbeat: float, busy_s: float,
               comm_kwargs: Dict[str, Any]) -> None:
    import reliability_cases as rc

    store, comm = rc._bootstrap(rank, world, port, "busy", 60.0, **comm_kwargs)
    comm.heartbeat_timeout = heartbeat
    report: Dict[str, Any] = dict(wrong=0)
    try:
        for step in range(3):
            if rank == world - 1 and step == 1:
                # Pure Python: holds the GIL all along, as a long forward pass
                # in Python would. The heartbeats run in C++ threads.
                t_end, x = time.monotonic() + busy_s, 0
                while time.monotonic() < t_end:
                    x += 1
            t0 = time.monotonic()
            if not _sum_check(comm, list(range(world))):
                report["wrong"] += 1
            report[f"wait{step}"] = time.monotonic() - t0
        report["gone"] = comm.gone_ranks()
    except pycomm.CommError as e:
        report["error"] = str(e)[:400]
    comm.close()
    conn.send(report)


def busy_rank_keeps_beating(world: int = 4, heartbeat: float = 0.5, busy_s: float = 3.0,
                            comm_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The last rank computes for ``busy_s`` (several heartbeat bounds) while
    the others wait for it in an all-reduce: nobody may declare it failed."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(world, _busy_rank, heartbeat, busy_s, comm_kwargs or {})
    reports = {r: (c.recv() if c.poll(90) else None) for r, c in enumerate(conns)}
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return dict(reports=reports, hung=len(hung))


def _second_death_rank(rank: int, world: int, port: int, conn, first: int, second: int) -> None:
    import reliability_cases as rc
    from pycomm.elastic import membership as elastic

    store, comm = rc._bootstrap(rank, world, port, "second", 10.0)
    conn.send("ready")
    old, members, report = comm, list(range(world)), dict(wrong=0, attempts=0)
    while True:
        try:
            if not _sum_check(comm, members):
                report["wrong"] += 1
            if comm.epoch:
                break
        except pycomm.CommError:
            if rank == second:
                # Dies in the middle of the shrink: after checking in, before
                # the new communicator is built.
                elastic._agreement_store(old, 0).set(f"alive/{rank}", pycomm.bootstrap.process_record())
                os.kill(os.getpid(), signal.SIGKILL)
            for _ in range(5):
                report["attempts"] += 1
                t0 = time.monotonic()
                try:
                    # The full 30 s bootstrap timeout: the dead member's
                    # check-in record must end the attempt long before.
                    comm = elastic.shrink(old, timeout=30.0)
                    break
                except pycomm.CommError as e:
                    report["retry_error"] = str(e)[:300]
                    report["failed_attempt_s"] = time.monotonic() - t0
            else:
                raise AssertionError(f"no shrink held in 5 attempts: {report}")
            members = [r for r in comm.parent_ranks]
    report.update(members=members, epoch=comm.epoch)
    comm.close()
    conn.send(report)


def second_death_during_shrink(world: int = 4) -> Dict[str, Any]:
    """Rank 0 dies; rank 1 dies during the survivors' shrink (after checking
    in). The first attempt fails on every survivor with a clear error, as
    soon as they see the process gone; the second gives the two that are
    left one communicator."""
    import reliability_cases as rc

    first, second = 0, 1
    store_pid, pids, conns = rc.fork_ranks(world, _second_death_rank, first, second)
    for c in conns:
        if not c.poll(rc.START_S) or c.recv() != "ready":
            rc.reap(pids + [store_pid], 0)
            raise AssertionError("a rank did not start")
    time.sleep(0.2)
    os.kill(pids[first], signal.SIGKILL)
    reports = {r: (c.recv() if c.poll(60) else None) for r, c in enumerate(conns) if r not in (first, second)}
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return dict(reports=reports, hung=len(hung))


# --- Newcomers that fail on their way in --------------------------------------------------------------------------

def _admit_member(rank: int, world: int, port: int, conn, tickets: int, heartbeat: float, fate: str = "") -> None:
    """A member: once ``tickets`` newcomers have taken tickets and the driver
    says go, admit them (the full 30 s timeout); if that fails, shrink. With
    ``fate`` "member dies", the last member is killed once the admission is
    agreed, before it bootstraps the new communicator."""
    import reliability_cases as rc
    from pycomm.elastic import membership

    if fate == "member dies" and rank == world - 1:
        membership._successor = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    store, comm = rc._bootstrap(rank, world, port, "admit", 30.0)
    comm.heartbeat_timeout = heartbeat
    js = membership._job_store(store, comm.job)
    while js.add("tickets", 0) < tickets:
        time.sleep(0.01)
    conn.send("ready")
    conn.recv()
    out: Dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        new = elastic.admit(comm, timeout=30.0)
        out.update(world=new.world_size)
    except pycomm.CommError as e:
        out.update(error=str(e)[:400], failed_s=time.monotonic() - t0)
        new = elastic.shrink(comm, timeout=30.0)
        out.update(world=new.world_size, parents=new.parent_ranks)
    out["seconds"] = time.monotonic() - t0
    out["ok"] = _sum_check(new, list(range(new.world_size)))
    new.close()
    conn.send(out)


def _admit_joiner(uid: int, world: int, port: int, conn, fate: str) -> None:
    """A newcomer: "lives", or dies ("dies") / freezes ("stops") the moment
    its admission arrives, before its bootstrap (a replacement killed as it
    joins)."""
    import datetime

    import torch.distributed as dist
    from pycomm.elastic import membership

    if fate in ("dies", "stops"):
        sig = signal.SIGKILL if fate == "dies" else signal.SIGSTOP
        membership._build = lambda *a, **k: os.kill(os.getpid(), sig)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    if fate == "gives up":  # its join times out before any admit, and the process lives on
        try:
            elastic.join(store, "admit", timeout=0.5)
            conn.send(dict(gave_up=False))
        except pycomm.CommError as e:
            conn.send(dict(gave_up="did not admit" in str(e)))
        time.sleep(600)
    comm = elastic.join(store, "admit", timeout=60.0)
    conn.send(dict(world=comm.world_size, rank=comm.rank, ok=_sum_check(comm, list(range(comm.world_size)))))
    comm.close()


def newcomer_fails(members: int, fate: str, heartbeat: float = 1.0) -> Dict[str, Any]:
    """``members`` ranks and newcomers that fail on their way in:

    - "killed while waiting": a newcomer takes a ticket and is killed before
      any admission; a second one lives. The admission takes the live one only.
    - "killed before its record": a ticket whose process vanished between
      taking it and publishing its process record (taken here, by nobody);
      a second newcomer lives. The same outcome.
    - "dies" / "stops": the only newcomer dies / freezes when its admission
      arrives. The members' admit fails at once (not at its 30 s timeout),
      then they shrink back to themselves.
    - "member dies": the last member is killed once the admission is agreed,
      before its bootstrap of the new communicator: the other members' admit
      fails at once, and they shrink to themselves (the newcomer's join fails).
    - "gives up": the only newcomer's join times out before the members
      admit, and its process lives on: the members' admit takes nobody.

    Returns the members' reports, the live newcomer's and the hung count."""
    import multiprocessing as mp

    import torch.distributed as dist
    from harness import free_port
    from pycomm.elastic import membership

    import reliability_cases as rc

    port = free_port()
    two = fate in ("killed while waiting", "killed before its record")
    store_pid, pids, conns = rc.fork_ranks(members, _admit_member, 2 if two else 1,
                                           heartbeat, fate, duplex=True, port=port)
    victim = members - 1 if fate == "member dies" else None
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    js = membership._job_store(store, "admit")
    joiners, pipes = [], []

    def newcomer(what: str) -> None:
        parent, child = mp.Pipe()
        joiners.append(rc._start_rank(_admit_joiner, len(joiners), 0, port, child, (what,)))
        child.close()
        pipes.append(parent)

    if fate == "killed while waiting":
        newcomer("lives")
        while js.add("tickets", 0) < 1:
            time.sleep(0.01)
        os.kill(joiners[0], signal.SIGKILL)
        os.waitpid(joiners[0], 0)  # reaped: gone from the process table
        newcomer("lives")
    elif fate == "killed before its record":
        js.add("tickets", 1)
        joiners.append(None)  # nobody to reap
        newcomer("lives")
    else:
        newcomer("lives" if fate == "member dies" else fate)
    gave_up = pipes[-1].recv() if fate == "gives up" and pipes[-1].poll(30) else None
    for c in conns:
        assert c.poll(rc.START_S) and c.recv() == "ready", "a member did not start"
    for c in conns:
        c.send("go")
    reports = {r: (c.recv() if c.poll(90) else None) for r, c in enumerate(conns) if r != victim}
    live = pipes[-1].recv() if two and pipes[-1].poll(30) else None
    for pid in joiners[1:] if two else joiners:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap(joiners[1:] if two else joiners, time.monotonic() + 5)
    rc.reap([store_pid], 0)
    return dict(reports=reports, newcomer=live, hung=len(hung), gave_up=gave_up)


def _core_constructing_with(construct: Callable[..., None]) -> None:
    """Makes this process's bootstrap build its core communicator with
    ``construct(real_core, **kwargs)`` (a death placed inside a bootstrap)."""
    from pycomm import bootstrap

    real = bootstrap.load_core()

    class Core:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def Communicator(self, **kwargs: Any) -> None:  # noqa: N802 - the core's constructor
            construct(real, **kwargs)

    bootstrap.load_core = lambda: Core()


def _bootstrap_and_report(rank: int, world: int, port: int, name: str, conn) -> None:
    """Bootstraps a communicator; reports ok, or the error and how long it took."""
    import reliability_cases as rc

    t0 = time.monotonic()
    try:
        _, comm = rc._bootstrap(rank, world, port, name, 30.0)
        conn.send(dict(ok=True))
        comm.close()
    except pycomm.CommError as e:
        conn.send(dict(error=str(e)[:300], seconds=time.monotonic() - t0))


def _dies_before_attaching(rank: int, world: int, port: int, conn) -> None:
    """The last rank dies once the segment exists, before it maps it."""
    if rank == world - 1:
        _core_constructing_with(lambda real, **kwargs: os.kill(os.getpid(), signal.SIGKILL))
    _bootstrap_and_report(rank, world, port, "attach", conn)


def _creator_dies_before_saying_so(rank: int, world: int, port: int, conn) -> None:
    """Rank 0, the host's first, creates the segment (and maps it) and dies
    before it tells the store: no other rank ever maps it."""
    def create_then_die(real: Any, **kwargs: Any) -> None:
        real.Communicator(**kwargs)
        conn.send(dict(segments=sorted(f for f in os.listdir("/dev/shm") if kwargs["token"] in f)))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 0:
        _core_constructing_with(create_then_die)
    _bootstrap_and_report(rank, world, port, "creator", conn)


def creator_dies_before_saying_so(world: int = 3) -> Dict[str, Any]:
    """The others give up at once, and the segment the dead creator made is
    gone from /dev/shm once they did (nobody else would remove it)."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(world, _creator_dies_before_saying_so)
    made = conns[0].recv() if conns[0].poll(60) else {}
    reports = {r: (c.recv() if c.poll(60) else None) for r, c in enumerate(conns) if r}
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    left = [f for f in made.get("segments", []) if os.path.exists(f"/dev/shm/{f}")]
    return dict(made=made.get("segments", []), reports=reports, hung=len(hung), left=left)


def death_before_attaching(world: int = 3) -> Dict[str, Any]:
    """A rank dies between the segment's creation and its own attach: the
    others, waiting for every local rank to map the segment, give up at once
    (not at the 30 s timeout)."""
    import reliability_cases as rc

    store_pid, pids, conns = rc.fork_ranks(world, _dies_before_attaching)
    reports = {r: (c.recv() if c.poll(60) else None) for r, c in enumerate(conns[:-1])}
    hung = rc.reap(pids, time.monotonic() + 10)
    rc.reap([store_pid], 0)
    return dict(reports=reports, hung=len(hung))


# --- Spares: newcomers beyond max_world_size wait for room --------------------------------------------------------

_SPARE_MAX = 4


def _spare_steps(comm, stage: int) -> Dict[str, Any]:
    """Stages 0-4 of the spares scenario, from ``stage`` on (where this rank
    came in): admit under the bound (room for one), admit again (no room),
    shrink rank 1 out on purpose, admit (the first spare fills the room),
    check a sum over the members' ranks. Reports (world, rank, epoch) after
    each stage it ran, and whether the no-room admit returned ``comm``."""
    out: Dict[str, Any] = dict(worlds=[])
    for s in range(stage, 5):
        if s in (0, 1, 3):
            new = elastic.admit(comm, timeout=30.0, max_world_size=_SPARE_MAX)
            if s == 1:
                out["kept"] = new is comm
            comm = new
        elif s == 2:
            try:
                comm = elastic.shrink(comm, exclude=[1], timeout=30.0)
            except elastic.FencedOut:
                out["fenced"] = True
                return out
        else:
            out["ok"] = _sum_check(comm, list(range(comm.world_size)))
        out["worlds"].append((comm.world_size, comm.rank, comm.epoch))
    out["name"] = comm.name
    comm.close()
    return out


def _spare_member(rank: int, world: int, port: int, conn) -> None:
    import reliability_cases as rc

    _, comm = rc._bootstrap(rank, world, port, "spares", 30.0)
    conn.send("ready")
    conn.recv()
    conn.send(_spare_steps(comm, 0))


def _spare_joiner(uid: int, world: int, port: int, conn, stage: int) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    comm = elastic.join(store, "spares", timeout=60.0)
    out = dict(joined=(comm.world_size, comm.rank, comm.epoch))
    out.update(_spare_steps(comm, stage))
    conn.send(out)


def spares_wait_for_room(members: int = 3) -> Dict[str, Any]:
    """``members`` ranks under ``max_world_size=members + 1`` and three
    newcomers, tickets 1, 2, 3: the first admit takes ticket 1 only, the next
    takes nobody (no room: tickets 2 and 3 wait as spares), a shrink makes
    room and the next admit takes ticket 2; ticket 3 still waits, never
    admitted. Returns every participant's report, whether ticket 3 was ever
    admitted, and the hung count."""
    import multiprocessing as mp

    import torch.distributed as dist
    from harness import free_port
    from pycomm.elastic import membership

    import reliability_cases as rc

    assert _SPARE_MAX == members + 1
    port = free_port()
    store_pid, pids, conns = rc.fork_ranks(members, _spare_member, duplex=True, port=port)
    js = membership._job_store(dist.TCPStore("127.0.0.1", port, is_master=False), "spares")
    joiners, pipes = [], []
    for ticket, stage in ((1, 1), (2, 4), (3, 5)):  # where each comes in (5: never)
        parent, child = mp.Pipe()
        joiners.append(rc._start_rank(_spare_joiner, ticket, 0, port, child, (stage,)))
        child.close()
        pipes.append(parent)
        while js.add("tickets", 0) < ticket:  # tickets in this order
            time.sleep(0.01)
    for c in conns:
        assert c.poll(rc.START_S) and c.recv() == "ready", "a member did not start"
    for c in conns:
        c.send("go")
    reports = {f"member {r}": (c.recv() if c.poll(90) else None) for r, c in enumerate(conns)}
    reports.update({f"ticket {t}": (p.recv() if p.poll(30) else None) for t, p in ((1, pipes[0]), (2, pipes[1]))})
    third_admitted = js.check(["admitted/3"])
    os.kill(joiners[2], signal.SIGKILL)
    hung = rc.reap(pids + joiners[:2], time.monotonic() + 10)
    rc.reap(joiners[2:] + [store_pid], 0)
    return dict(reports=reports, third_admitted=third_admitted, hung=len(hung))
