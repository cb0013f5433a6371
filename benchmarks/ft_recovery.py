"""Recovery of data-parallel training after kill -9: pycomm's FaultTolerantDDP
against torchrun --max-restarts with checkpoints, measured in the same run.

Every trial trains the same MLP (64 -> width -> width -> 10, SGD with
momentum, a global batch of 64 split over the ranks) and kills one random
rank (kill -9, itself, at the start of a random step; it writes the time
first). Clocks are CLOCK_MONOTONIC, one clock for every process of the
machine (network namespaces included).

* ``--mode pycomm``: a Store process and ``--world`` ranks (spawned);
  FaultTolerantDDP with the allreduce hook. Recovery = kill to the slowest
  survivor's next completed step on the shrunk world; steps lost: none
  (the failed step is redone by the survivors).
* ``--mode torchrun``: ``torchrun --standalone --max-restarts 1
  --monitor-interval 0.1`` of the same training on Gloo DDP, rank 0 saving a
  checkpoint every ``--ckpt-every`` steps. Recovery = kill to the slowest
  rank's first completed step after the restart; steps lost = the steps
  since the last checkpoint, redone at the measured step time.
* ``--path group`` (pycomm): the buckets go over a Gloo group per
  membership epoch, the path a CUDA model's take (over NCCL).
* ``--freeze`` (pycomm, testbed): the victim stops itself (SIGSTOP) instead
  of dying: the survivors find it by its heartbeat (``--heartbeat``, the
  bound in seconds); continued at the end, it must say that it is out.
  Recovery = freeze to the slowest survivor's next completed step.
* ``--mode heartbeat``: the steady step time with pycomm's heartbeats
  (default, or a bound of ``--heartbeat`` s; with ``--local-size`` the ranks
  of other hosts beat on the Store too) and without (PYCOMM_HEARTBEAT_S=0),
  alternating launches.
* ``--mode testbed``: run under benchmarks/multihost/testbed.py, one process
  per host (``--nproc-per-host 1``) that starts ``--local-ranks`` ranks and
  uses torchrun's agent store (it outlives every rank); host 0 prints.

Examples::

    python benchmarks/ft_recovery.py --mode pycomm --trials 20
    python benchmarks/ft_recovery.py --mode torchrun --trials 5 --ckpt-every 50
    python benchmarks/ft_recovery.py --mode pycomm --trials 20 --local-size 2 --freeze --heartbeat 1
    python benchmarks/ft_recovery.py --mode pycomm --trials 20 --path group
    python benchmarks/ft_recovery.py --mode heartbeat --trials 6
    python benchmarks/multihost/testbed.py --hosts 2 --nproc-per-host 1 -- \\
        benchmarks/ft_recovery.py --mode testbed --local-ranks 2 --trials 20
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import free_port  # noqa: E402

GLOBAL_BATCH = 64


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 64, generator=g)
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    return torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]


def _die(store: "dist.Store", key: str, freeze: bool = False) -> None:
    """kill -9 of this process, or with ``freeze`` SIGSTOP (until continued)."""
    store.set(key, repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGSTOP if freeze else signal.SIGKILL)


# -------------------------------------------------------------- pycomm


def pycomm_rank(store: "dist.Store", rank: int, world: int, name: str, victim: int, kill_step: int, steps: int,
                width: int, local_size: Optional[int] = None, heartbeat: bool = True, freeze: bool = False,
                bound: Optional[float] = None, path: str = "communicator") -> Dict[str, Any]:
    import pycomm
    from pycomm import hooks
    from pycomm.elastic import FaultTolerantDDP

    torch.set_num_threads(1)
    if not heartbeat:
        os.environ["PYCOMM_HEARTBEAT_S"] = "0"
    comm = pycomm.Communicator(store=store, rank=rank, world_size=world, name=name, timeout=30,
                               local_size=local_size)
    if bound is not None:
        comm.heartbeat_timeout = bound
    model = make_model(width)
    ft = FaultTolerantDDP(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), comm,
                          hook=hooks.allreduce_hook, state=hooks.AllReduceState(path=path), admit_every=0)

    def fn(step: int) -> None:
        if rank == victim and step == kill_step:
            _die(store, f"{name}/t_kill", freeze)
        x, y = batch(step, ft.rank, ft.world_size)
        torch.nn.functional.cross_entropy(ft(x), y).backward()

    done = []
    while ft.steps_done < steps:
        ft.step(lambda: fn(ft.steps_done))
        done.append((ft.steps_done, time.monotonic(), ft.world_size))
    comm = ft.comm
    comm.close()
    return dict(done=done)


def _rank_main(conn, rank: int, store_addr: str, store_port: int, *args: Any, **kwargs: Any) -> None:
    try:
        store = dist.TCPStore(store_addr, store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
        conn.send(pycomm_rank(store, rank, *args, **kwargs))
    except BaseException as e:  # noqa: BLE001
        conn.send(dict(error=f"{type(e).__name__}: {e}"))


def launch_ranks(ranks: List[int], store_addr: str, store_port: int, *args: Any, frozen: Optional[int] = None,
                 **kwargs: Any) -> Dict[int, Any]:
    """One fresh process per rank (spawned: a fork of a process that imported
    torch is not safe with every torch build) running pycomm_rank; their
    reports (the killed rank's: None). Startup is not timed. Rank ``frozen``
    stops itself: once the others reported it is continued, and must say
    that it is out (its report: None)."""
    ctx = mp.get_context("spawn")
    conns, procs = {}, {}
    for r in ranks:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(child, r, store_addr, store_port, *args),
                        kwargs=dict(kwargs, freeze=r == frozen))
        p.start()
        child.close()
        conns[r] = parent
        procs[r] = p
    out = {}
    for r in sorted(conns, key=lambda r: r == frozen):
        c = conns[r]
        if r == frozen:
            os.kill(procs[r].pid, signal.SIGCONT)
        try:
            out[r] = c.recv() if c.poll(300) else None
        except EOFError:
            out[r] = None
        if r == frozen:
            said = (out[r] or {}).get("error", "")
            if "fenced out" not in said and "declared failed" not in said:
                raise RuntimeError(f"the frozen rank {r}, continued, did not say it is out: {out[r]}")
            out[r] = None
    for p in procs.values():
        p.join(10)
        if p.is_alive():
            p.kill()
    return out


def recovery_of(reports: Dict[int, Any], t_kill: float, world: int) -> Dict[str, float]:
    """Kill to the slowest survivor's first step completed after it on the
    shrunk world, and the steady step time before the kill."""
    firsts, steps = [], []
    for rep in reports.values():
        if rep is None:
            continue
        if "error" in rep:
            raise RuntimeError(rep["error"])
        done = rep["done"]
        firsts.append(min(t for _, t, w in done if t > t_kill and w == world - 1))
        before = [t for _, t, _ in done if t < t_kill]
        steps += [b - a for a, b in zip(before, before[1:])]
    return dict(recovery_s=max(firsts) - t_kill, step_s=statistics.median(steps) if steps else float("nan"))


def _serve_store(port: int, world: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    while store is not None:  # serves until killed
        time.sleep(3600)


@contextlib.contextmanager
def store_server(world: int) -> Iterator[int]:
    """The Store's host, a process of its own that outlives every rank (like
    torchrun's agent), for the block; yields its port."""
    port = free_port()
    p = mp.get_context("spawn").Process(target=_serve_store, args=(port, world), daemon=True)
    p.start()
    try:
        yield port
    finally:
        p.kill()
        p.join()


def run_pycomm(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    rec = []
    for i in range(args.trials):
        victim, kill_step = rng.randrange(args.world), rng.randrange(20, args.steps - 10)
        with store_server(args.world) as port:
            store = dist.TCPStore("127.0.0.1", port, args.world, is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
            reports = launch_ranks(list(range(args.world)), "127.0.0.1", port, args.world, f"t{i}", victim,
                                   kill_step, args.steps, args.width, args.local_size, bound=args.heartbeat,
                                   path=args.path, frozen=victim if args.freeze else None)
            errors = [rep["error"] for rep in reports.values() if rep and "error" in rep]
            if errors or not store.check([f"t{i}/t_kill"]):
                raise RuntimeError(f"trial {i + 1}: the victim did not die as planned; ranks said: {errors}")
            t_kill = float(store.get(f"t{i}/t_kill").decode())
        r = recovery_of(reports, t_kill, args.world)
        rec.append(r)
        print(f"trial {i + 1}: rank {victim} {failure(args)} at step {kill_step}; next completed step "
              f"{r['recovery_s'] * 1e3:.1f} ms after it (step {r['step_s'] * 1e3:.1f} ms)", flush=True)
    summary("pycomm FaultTolerantDDP" + (" (group path: Gloo per epoch)" if args.path == "group" else ""), args,
            rec)


def failure(args: argparse.Namespace) -> str:
    """What happens to the victim, as the reports say it."""
    if not args.freeze:
        return "killed"
    return f"frozen (SIGSTOP; heartbeat bound {args.heartbeat if args.heartbeat is not None else 'default'} s)"


def summary(what: str, args: argparse.Namespace, rec: List[Dict[str, float]], extra: str = "") -> None:
    t = sorted(r["recovery_s"] for r in rec)
    layout = f"{args.world} ranks" + (f", {args.world // args.local_size} simulated hosts" if args.local_size else "")
    event = "freeze" if args.freeze else "kill"
    print(f"{what}, {layout}, width {args.width}, {len(t)} trials: {event} to next completed step min "
          f"{t[0] * 1e3:.1f} / median {statistics.median(t) * 1e3:.1f} / max {t[-1] * 1e3:.1f} ms; steady step "
          f"{statistics.median(r['step_s'] for r in rec) * 1e3:.1f} ms{extra}", flush=True)


# -------------------------------------------------------------- torchrun


def torchrun_worker(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store outlives a restart; Gloo's keys of the killed attempt
    # are still in it (a restarted rank read a dead peer's address and gave
    # up), so each attempt bootstraps under keys of its own.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{restart}/", store), rank=rank,
                            world_size=world)
    model = make_model(args.width)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = os.path.join(args.dir, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    times = []
    for step in range(start, args.steps):
        if restart == 0 and rank == args.victim and step == args.kill_step:
            with open(os.path.join(args.dir, "t_kill"), "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank, world)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.monotonic())
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if (restart == 0 and (step + 1) % 10 == 0) or (restart > 0 and step == start):
            with open(os.path.join(args.dir, f"r{restart}.{rank}.json"), "w") as f:
                json.dump(dict(start=start, times=times), f)
    dist.destroy_process_group()


def run_torchrun(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    rec = []
    for i in range(args.trials):
        victim, kill_step = rng.randrange(args.world), rng.randrange(20, args.steps - 10)
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
                   "--max-restarts=1", "--monitor-interval=0.1", os.path.abspath(__file__), "--torchrun-worker",
                   "--dir", d, "--victim", str(victim), "--kill-step", str(kill_step), "--steps", str(args.steps),
                   "--width", str(args.width), "--ckpt-every", str(args.ckpt_every)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
            t_kill = float(open(os.path.join(d, "t_kill")).read())
            after = [json.load(open(os.path.join(d, f"r1.{r}.json"))) for r in range(args.world)]
            before = json.load(open(os.path.join(d, f"r0.{(victim + 1) % args.world}.json")))
        first = max(a["times"][0] for a in after)
        lost = kill_step - after[0]["start"]
        t = before["times"]
        step_s = statistics.median(b - a for a, b in zip(t[5:], t[6:]))
        r = dict(recovery_s=first - t_kill, step_s=step_s, lost=lost, regain_s=first - t_kill + lost * step_s)
        rec.append(r)
        print(f"trial {i + 1}: rank {victim} killed at step {kill_step}; first step after the restart "
              f"{r['recovery_s'] * 1e3:.0f} ms after the kill; {lost} steps lost (back where it was "
              f"{r['regain_s'] * 1e3:.0f} ms after the kill)", flush=True)
    lost = sorted(r["lost"] for r in rec)
    regain = sorted(r["regain_s"] for r in rec)
    summary(f"torchrun --max-restarts (checkpoint every {args.ckpt_every} steps)", args, rec,
            f"; steps lost min {lost[0]} / median {statistics.median(lost)} / max {lost[-1]}; back where it was "
            f"min {regain[0] * 1e3:.0f} / median {statistics.median(regain) * 1e3:.0f} / max {regain[-1] * 1e3:.0f} ms")


# -------------------------------------------------------------- heartbeat overhead


def run_heartbeat(args: argparse.Namespace) -> None:
    out: Dict[bool, List[float]] = {True: [], False: []}
    for i in range(args.trials):
        for beat in ((True, False) if i % 2 == 0 else (False, True)):
            with store_server(args.world) as port:
                reports = launch_ranks(list(range(args.world)), "127.0.0.1", port, args.world, f"h{i}{beat}", -1,
                                       -1, args.steps, args.width, args.local_size, heartbeat=beat,
                                       bound=args.heartbeat if beat else None)
            # Steady state: the second half of the run, slowest rank per step.
            per_rank = [[t for _, t, _ in rep["done"]] for rep in reports.values()]
            ends = [max(ts) for ts in zip(*per_rank)]
            half = ends[len(ends) // 2:]
            out[beat].append((half[-1] - half[0]) / (len(half) - 1))
            print(f"launch {i + 1}: heartbeat {'on ' if beat else 'off'} step {out[beat][-1] * 1e3:.2f} ms",
                  flush=True)
    for beat in (True, False):
        s = sorted(out[beat])
        print(f"heartbeat {'on ' if beat else 'off'}: step min {s[0] * 1e3:.2f} / median "
              f"{statistics.median(s) * 1e3:.2f} / max {s[-1] * 1e3:.2f} ms over {len(s)} launches")
    ratio = statistics.median(out[True]) / statistics.median(out[False])
    print(f"on / off (medians): {ratio:.4f}")


# -------------------------------------------------------------- testbed


def run_testbed(args: argparse.Namespace) -> None:
    """One process per simulated host (under torchrun): start the host's ranks
    for each trial; torchrun's agent store outlives them."""

    host, hosts = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = hosts * args.local_ranks
    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    rng = random.Random(args.seed)
    rec = []
    for i in range(args.trials):
        victim, kill_step = rng.randrange(world), rng.randrange(20, args.steps - 10)
        mine = [host * args.local_ranks + j for j in range(args.local_ranks)]
        reports = launch_ranks(mine, addr, port, world, f"ft-testbed/t{i}", victim, kill_step, args.steps,
                               args.width, bound=args.heartbeat, frozen=victim if args.freeze else None)
        for r, rep in reports.items():
            store.set(f"ft-testbed/t{i}/report/{r}", json.dumps(rep))
        if host == 0:
            keys = [f"ft-testbed/t{i}/report/{r}" for r in range(world) if r != victim]
            store.wait(keys, datetime.timedelta(seconds=120))
            got = {int(k.rsplit("/", 1)[1]): json.loads(store.get(k)) for k in keys}
            t_kill = float(store.get(f"ft-testbed/t{i}/t_kill").decode())
            r = recovery_of(got, t_kill, world)
            rec.append(r)
            print(f"trial {i + 1}: rank {victim} {failure(args)} at step {kill_step}; next completed step "
                  f"{r['recovery_s'] * 1e3:.1f} ms after it (step {r['step_s'] * 1e3:.1f} ms)", flush=True)
        store.add(f"ft-testbed/t{i}/done", 1)
        store.wait([f"ft-testbed/t{i}/go"] if host else [], datetime.timedelta(seconds=120))
        if host == 0:
            while int(store.add(f"ft-testbed/t{i}/done", 0)) < hosts:
                time.sleep(0.01)
            store.set(f"ft-testbed/t{i}/go", "1")
    if host == 0:
        args.world, args.local_size = world, None
        summary(f"pycomm FaultTolerantDDP on the testbed ({hosts} hosts x {args.local_ranks} ranks)", args, rec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("pycomm", "torchrun", "heartbeat", "testbed"), default="pycomm")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--local-size", type=int, default=None, help="simulate hosts of this many ranks (pycomm)")
    ap.add_argument("--local-ranks", type=int, default=2, help="ranks per testbed host")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--freeze", action="store_true",
                    help="pycomm/testbed: the victim stops (SIGSTOP) instead of dying; continued at the end, it "
                         "must say it is out")
    ap.add_argument("--path", choices=("communicator", "group"), default="communicator",
                    help="pycomm: buckets through the communicator, or over a Gloo group per membership epoch "
                         "(the path CUDA models take, there over NCCL)")
    ap.add_argument("--heartbeat", type=float, default=None, help="pycomm/testbed: comm.heartbeat_timeout (s)")
    # torchrun's workers
    ap.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--victim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--kill-step", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args)
    elif args.mode == "pycomm":
        run_pycomm(args)
    elif args.mode == "torchrun":
        run_torchrun(args)
    elif args.mode == "heartbeat":
        run_heartbeat(args)
    else:
        run_testbed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
