"""What every pipeline schedule is: for each rank, an ordered list of
actions on the (virtual) stages it holds. Schedules are plain functions
``schedule(num_ranks, num_microbatches, rank) -> List[Action]``, so they can
be checked and simulated without processes.

A model is cut into S stages (S = number of ranks, or ranks x virtual stages
for interleaved and V-shaped schedules). An action names its stage; which
rank holds which stage follows from the actions themselves. Three kinds of
action:

- ``F``: forward of one micro-batch through one stage;
- ``B``: its backward. When the schedule also has a ``W`` for that stage and
  micro-batch, ``B`` computes only the gradient of the stage's inputs (what
  the previous stage waits for), and ``W`` the gradients of its weights
  later, where it fills a bubble (zero-bubble schedules, Qi et al., 2024).

The runner sends a stage's output to the next stage right after its forward
and its input gradients to the previous stage right after its (input-)
backward; between two ranks, messages travel in the order the sender's list
runs them, and receivers post their receives in that order. A schedule is
valid when every stage runs each micro-batch's F and B exactly once (and W at
most once), B after F, W after B, and the dependencies between ranks never
wait in a cycle (:func:`simulate` checks that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple


class Action(NamedTuple):
    """One step of a rank: ``op`` is ``"F"``, ``"B"`` or ``"W"``; ``stage`` is
    the global (virtual) stage, or None for the rank's only stage."""

    op: str
    microbatch: int
    stage: Optional[int] = None

    def __repr__(self) -> str:
        s = f"{self.op}{self.microbatch}"
        return s if self.stage is None else f"{s}@{self.stage}"


Schedule = Callable[[int, int, int], List[Action]]


def check_args(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")


def bubble_theory(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of GPipe / 1F1B with equal stages, (p-1)/(m+p-1); with
    ``virtual_stages`` v (interleaved 1F1B, each rank's work cut into v
    chunks): (p-1)/(v*m+p-1)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def zero_bubble_theory(num_stages: int, num_microbatches: int, virtual_stages: int = 1, forward: float = 1.0,
                       input_backward: float = 1.0, weight_backward: float = 1.0) -> float:
    """Idle fraction of ZB-H1 (Qi et al., 2024), and of its interleaved form
    with v chunks per rank: each rank idles (p-1)(F+B-W) (per-chunk times)
    of a step that computes v*m(F+B+W); with F = B = W, (p-1)/(3vm+p-1), a
    third of (interleaved) 1F1B's idle time."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    idle = (p - 1) * max(0.0, forward + input_backward - weight_backward)
    return idle / (v * m * (forward + input_backward + weight_backward) + idle)


def normalize(actions: Sequence[Action], rank: int) -> List[Action]:
    """``actions`` with every ``stage=None`` replaced by ``rank`` (a schedule
    of one stage per rank may leave the stage out)."""
    return [a if a.stage is not None else Action(a.op, a.microbatch, rank) for a in actions]


def plans(schedule: Schedule, num_ranks: int, num_microbatches: int) -> List[List[Action]]:
    """Every rank's normalized action list."""
    return [normalize(schedule(num_ranks, num_microbatches, r), r) for r in range(num_ranks)]


def placement(all_plans: Sequence[Sequence[Action]]) -> List[int]:
    """``stage -> rank`` from every rank's actions; raises ValueError unless
    the stages are 0..S-1 and each lives on exactly one rank."""
    owner: Dict[int, int] = {}
    for r, plan in enumerate(all_plans):
        for a in plan:
            if owner.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} has actions on ranks {owner[a.stage]} and {r}")
    num = len(owner)
    if sorted(owner) != list(range(num)):
        raise ValueError(f"stages must be 0..S-1, got {sorted(owner)}")
    return [owner[s] for s in range(num)]


def split_backward(actions: Sequence[Action]) -> set:
    """(stage, microbatch) pairs whose backward is split into B and W."""
    return {(a.stage, a.microbatch) for a in actions if a.op == "W"}


def validate(actions: Sequence[Action], num_microbatches: int, rank: int) -> None:
    """Raises ValueError unless the rank runs F and B of every micro-batch of
    each of its stages once, B after F, and at most one W after B."""
    seen: Dict[Tuple[str, int, int], int] = {}
    stages = set()
    for i, a in enumerate(normalize(actions, rank)):
        if a.op not in ("F", "B", "W") or not 0 <= a.microbatch < num_microbatches or a.stage < 0:
            raise ValueError(f"rank {rank}: invalid action {a!r}")
        key = (a.op, a.stage, a.microbatch)
        if key in seen:
            raise ValueError(f"rank {rank}: {a!r} appears twice")
        before = {"B": "F", "W": "B"}.get(a.op)
        if before and (before, a.stage, a.microbatch) not in seen:
            what = "its forward" if before == "F" else "its backward"
            raise ValueError(f"rank {rank}: {a!r} comes before {what}")
        seen[key] = i
        stages.add(a.stage)
    for s in stages:
        for op in ("F", "B"):
            n = sum(1 for (o, st, _) in seen if o == op and st == s)
            if n != num_microbatches:
                raise ValueError(f"rank {rank}: stage {s} runs {n} {op} actions, expected {num_microbatches}")


@dataclass
class Simulation:
    """What :func:`simulate` finds: time of the whole step, each rank's busy
    time, and each rank's peak number of (stage, micro-batch) activations it
    holds (forward done, last backward part not yet)."""

    makespan: float
    busy: List[float]
    peak_in_flight: List[int]
    timeline: List[List[Tuple[float, float, Action]]]

    @property
    def bubble(self) -> float:
        """Mean idle fraction over ranks."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def idle(self) -> float:
        """Mean idle time per rank."""
        return self.makespan - sum(self.busy) / len(self.busy)


def _deps(a: Action, last_stage: int) -> List[Tuple[str, int, int]]:
    s, k = a.stage, a.microbatch
    if a.op == "F":
        return [("F", s - 1, k)] if s > 0 else []
    if a.op == "B":
        return [("F", s, k)] + ([("B", s + 1, k)] if s < last_stage else [])
    return [("B", s, k)]


def simulate(schedule: Schedule, num_stages: int, num_microbatches: int, forward_time: float = 1.0,
             backward_time: float = 2.0, transfer_time: float = 0.0,
             weight_time: Optional[float] = None) -> Simulation:
    """Runs ``schedule`` on an ideal pipeline (every rank its own processor,
    fixed times per stage) and returns its timeline; raises ValueError if
    the ranks would wait on each other forever. ``num_stages`` is the number
    of ranks. ``backward_time`` is a whole backward; where a schedule splits
    it, W takes ``weight_time`` (default half) and B the rest.

    Example::

        sim = simulate(one_f_one_b, 4, 8)
        sim.bubble            # == bubble_theory(4, 8)
    """
    p, m = num_stages, num_microbatches
    all_plans = plans(schedule, p, m)
    for r, plan in enumerate(all_plans):
        validate(plan, m, r)
    owner = placement(all_plans)
    last = len(owner) - 1
    split = set().union(*(split_backward(plan) for plan in all_plans))
    w_time = backward_time / 2 if weight_time is None else weight_time
    end: Dict[Tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    timeline: List[List[Tuple[float, float, Action]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(all_plans[r]):
                a = all_plans[r][nxt[r]]
                deps = _deps(a, last)
                if any(d not in end for d in deps):
                    break
                ready = max([free[r]] + [end[d] + (transfer_time if owner[d[1]] != r else 0.0) for d in deps])
                is_split = (a.stage, a.microbatch) in split
                dur = {"F": forward_time, "B": backward_time - w_time if is_split else backward_time,
                       "W": w_time}[a.op]
                end[(a.op, a.stage, a.microbatch)] = ready + dur
                free[r] = ready + dur
                busy[r] += dur
                timeline[r].append((ready, ready + dur, a))
                if a.op == "F":
                    in_flight[r] += 1
                elif a.op == "W" or not is_split:
                    in_flight[r] -= 1
                peak[r] = max(peak[r], in_flight[r])
                nxt[r] += 1
                progress = True
    stuck = [r for r in range(p) if nxt[r] < len(all_plans[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {all_plans[r][nxt[r]]!r}" for r in stuck)
        raise ValueError(f"schedule deadlocks: {waits}")
    return Simulation(max(free), busy, peak, timeline)


def list_schedule(num_ranks: int, num_microbatches: int, owner: Sequence[int], *, split: bool,
                  limit: Sequence[int], prefer_deeper: bool = True,
                  window: Optional[int] = None) -> List[List[Action]]:
    """Builds every rank's action list by running a greedy list scheduler
    on unit times (F = B = W = 1; an unsplit B = 2) and recording the order.

    At each moment a free rank picks, among what is ready: a backward first
    (it unblocks the previous stage), then a forward if the rank holds fewer
    than ``limit[rank]`` activations (freed by W when ``split``, else by B),
    then a pending W (it depends on nobody and nobody waits for it, so it
    fills what would be a bubble). Ties go to the deeper stage with
    ``prefer_deeper`` (the work nearer the loss first). Per stage, F and B
    run in micro-batch order. With ``window`` w, a rank runs the forward of
    micro-batch k on one of its stages only once its next stage has run
    k - w + 1 forwards (interleaved schedules: without it a rank can fill its
    memory with its first chunk's micro-batches and starve the rest).

    The order comes from one feasible timeline, so whatever the real times,
    every wait points to an action that started earlier in it: no cycle,
    no deadlock (and :func:`simulate` checks it again).
    """
    p, m, num = num_ranks, num_microbatches, len(owner)
    mine = [[s for s in range(num) if owner[s] == r] for r in range(p)]
    next_own = {s: next((t for t in mine[owner[s]] if t > s), None) for s in range(num)}
    b_time = 1.0 if split else 2.0
    end: Dict[Tuple[str, int, int], float] = {}
    nf, nb = [0] * num, [0] * num
    pending_w: List[List[Tuple[int, int]]] = [[] for _ in range(p)]
    free, held = [0.0] * p, [0] * p
    out: List[List[Action]] = [[] for _ in range(p)]
    left = sum(len(s) for s in mine) * m * (3 if split else 2)
    order = {"B": 0, "F": 1, "W": 2}

    def ready(cands: list, r: int, a: Action) -> None:
        # A candidate once its dependencies ran: (earliest start, op, stage, micro-batch).
        deps = _deps(a, num - 1)
        if all(d in end for d in deps):
            cands.append((max([free[r]] + [end[d] for d in deps]), a.op, a.stage, a.microbatch))

    while left:
        best = None
        for r in range(p):
            cands = []
            for s in mine[r]:
                k = nf[s]
                ahead = window is not None and next_own[s] is not None and k >= nf[next_own[s]] + window
                if k < m and held[r] < limit[r] and not ahead:
                    ready(cands, r, Action("F", k, s))
                if nb[s] < nf[s]:
                    ready(cands, r, Action("B", nb[s], s))
            if pending_w[r]:
                s, k = pending_w[r][0]
                cands.append((max(free[r], end[("B", s, k)]), "W", s, k))
            if not cands:
                continue
            t = min(c[0] for c in cands)
            pick = min((c for c in cands if c[0] <= t),
                       key=lambda c: (order[c[1]], -c[2] if prefer_deeper else c[2], c[3]))
            if best is None or t < best[0]:
                best = (t, r, pick)
        if best is None:
            raise ValueError("list_schedule: no rank can run anything (limit too small for this placement)")
        t, r, (_, op, s, k) = best
        dur = {"F": 1.0, "B": b_time, "W": 1.0}[op]
        end[(op, s, k)] = t + dur
        free[r] = t + dur
        out[r].append(Action(op, k, s))
        left -= 1
        if op == "F":
            nf[s] += 1
            held[r] += 1
        elif op == "B":
            nb[s] += 1
            if split:
                pending_w[r].append((s, k))
            else:
                held[r] -= 1
        else:
            pending_w[r].pop(0)
            held[r] -= 1
    return out
