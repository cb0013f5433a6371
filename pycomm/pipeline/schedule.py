"""What every pipeline schedule is: for each stage, an ordered list of
actions (forward or backward of one micro-batch). Schedules are plain
functions ``schedule(num_stages, num_microbatches, stage) -> List[Action]``,
so they can be checked and simulated without processes.

The runner sends a micro-batch's activations to the next stage right after
its forward and its input gradients to the previous stage right after its
backward; receives are posted ahead. A schedule is valid when every stage
runs each micro-batch's forward and backward exactly once, backward after
forward, and the dependencies between stages never wait in a cycle
(:func:`simulate` checks that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple


class Action(NamedTuple):
    """One step of a stage: ``op`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    op: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.op}{self.microbatch}"


Schedule = Callable[[int, int, int], List[Action]]


def check_args(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")


def bubble_theory(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of a synchronous pipeline with equal stages: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@dataclass
class Simulation:
    """What :func:`simulate` finds: time of the whole step, each stage's busy
    time, and each stage's peak number of micro-batches whose activations it
    holds (forward done, backward not yet)."""

    makespan: float
    busy: List[float]
    peak_in_flight: List[int]
    timeline: List[List[Tuple[float, float, Action]]]

    @property
    def bubble(self) -> float:
        """Mean idle fraction over stages."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def validate(actions: Sequence[Action], num_microbatches: int, stage: int) -> None:
    """Raises ValueError unless the stage runs F and B of every micro-batch once, B after F."""
    seen: Dict[Tuple[str, int], int] = {}
    for i, a in enumerate(actions):
        if a.op not in ("F", "B") or not 0 <= a.microbatch < num_microbatches:
            raise ValueError(f"stage {stage}: invalid action {a!r}")
        if (a.op, a.microbatch) in seen:
            raise ValueError(f"stage {stage}: {a!r} appears twice")
        if a.op == "B" and ("F", a.microbatch) not in seen:
            raise ValueError(f"stage {stage}: {a!r} comes before its forward")
        seen[(a.op, a.microbatch)] = i
    if len(seen) != 2 * num_microbatches:
        raise ValueError(f"stage {stage}: runs {len(seen)} actions, expected {2 * num_microbatches}")
    # The runner's channels carry each direction's messages in order.
    for op in ("F", "B"):
        order = [a.microbatch for a in actions if a.op == op]
        if order != sorted(order):
            raise ValueError(f"stage {stage}: {op} actions out of micro-batch order: {order}")


def simulate(schedule: Schedule, num_stages: int, num_microbatches: int, forward_time: float = 1.0,
             backward_time: float = 2.0, transfer_time: float = 0.0) -> Simulation:
    """Runs ``schedule`` on an ideal pipeline (every stage its own processor,
    fixed times) and returns its timeline; raises ValueError if the stages
    would wait on each other forever.

    Example::

        sim = simulate(one_f_one_b, 4, 8)
        sim.bubble            # == bubble_theory(4, 8)
    """
    p, m = num_stages, num_microbatches
    plans = [schedule(p, m, s) for s in range(p)]
    for s, plan in enumerate(plans):
        validate(plan, m, s)
    end: Dict[Tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    timeline: List[List[Tuple[float, float, Action]]] = [[] for _ in range(p)]
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while nxt[s] < len(plans[s]):
                a = plans[s][nxt[s]]
                if a.op == "F":
                    deps = [("F", s - 1, a.microbatch)] if s > 0 else []
                else:
                    deps = [("F", s, a.microbatch)] + ([("B", s + 1, a.microbatch)] if s < p - 1 else [])
                if any(d not in end for d in deps):
                    break
                ready = max([free[s]] + [end[d] + (transfer_time if d[1] != s else 0.0) for d in deps])
                dur = forward_time if a.op == "F" else backward_time
                end[(a.op, s, a.microbatch)] = ready + dur
                free[s] = ready + dur
                busy[s] += dur
                timeline[s].append((ready, ready + dur, a))
                in_flight[s] += 1 if a.op == "F" else -1
                peak[s] = max(peak[s], in_flight[s])
                nxt[s] += 1
                progress = True
    stuck = [s for s in range(p) if nxt[s] < len(plans[s])]
    if stuck:
        waits = ", ".join(f"stage {s} at {plans[s][nxt[s]]!r}" for s in stuck)
        raise ValueError(f"schedule deadlocks: {waits}")
    return Simulation(max(free), busy, peak, timeline)
