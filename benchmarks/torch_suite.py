"""PyTorch's own distributed test suite on Gloo and on pycomm, side by side.

For each world size, runs every CPU test of torch's distributed test base on
Gloo and on pycomm (tests/torch_suite.py: the suite's skip decorators see
Gloo, or MPI for the CPU all_to_all tests upstream runs on MPI only) and
prints a markdown table: tests passed per backend, the tests that pass on
Gloo and not on pycomm (the target is none, apart from the monitored_barrier
tests torch reserves for Gloo), and the reverse::

    python benchmarks/torch_suite.py                   # worlds 2, 3, 4 and 8 (~15 min on 2 cores)
    python benchmarks/torch_suite.py --worlds 2 -k broadcast
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)
import torch_suite  # noqa: E402

GATES: List[Tuple[str, List[str]]] = [("gloo", []), ("mpi", ["-k", "all_to_all"])]


def run_backend(backend: str, world: int, patterns: List[str], timeout: int) -> Tuple[Dict[str, dict], float]:
    """Every selected test on one backend, both gates; (records by test, wall seconds)."""
    records: Dict[str, dict] = {}
    t0 = time.time()
    for gate, select in GATES:
        args = ["--gate", gate, *select]
        for p in patterns:
            args += ["-k", p]
        for rec in torch_suite.launch(backend, world, args, test_timeout=timeout).values():
            # A test both gates select (all_to_all ones): the run that did not skip it, and a pass if
            # either passed it.
            old = records.get(rec["test"])
            if old is None or rec["status"] == "pass" or old["status"] == "skip":
                records[rec["test"]] = dict(rec, gate=gate)
    return records, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 8])
    ap.add_argument("-k", action="append", default=[], help="regex on test names (repeatable)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test")
    args = ap.parse_args()

    rows, lost, won = [], [], []
    for world in args.worlds:
        gloo, gloo_s = run_backend("gloo", world, args.k, args.timeout)
        ours, ours_s = run_backend("pycomm", world, args.k, args.timeout)
        gp = {t for t, r in gloo.items() if r["status"] == "pass"}
        pp = {t for t, r in ours.items() if r["status"] == "pass"}
        reserved = {t for t in gp - pp if torch_suite.GLOO_ONLY.fullmatch(t)}
        for t in sorted(gp - pp - reserved):
            lost.append((world, t, ours.get(t, {}).get("why", "not run")))
        for t in sorted(pp - gp):
            won.append((world, t, gloo.get(t, {}).get("why", "not run")))
        rows.append((world, len(gloo), len(gp), len(pp), len(gp - pp - reserved), len(reserved), len(pp - gp),
                     gloo_s, ours_s))
        print(f"# world {world}: gloo {len(gp)} pass, pycomm {len(pp)} pass, {len(gp - pp - reserved)} lost",
              file=sys.stderr, flush=True)

    print("| world | tests | pass gloo | pass pycomm | gloo pass, pycomm not | of them reserved for gloo by torch "
          "| pycomm pass, gloo not | wall gloo s | wall pycomm s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w, n, g, p, l, r, x, gs, ps in rows:
        print(f"| {w} | {n} | {g} | {p} | {l} | {r} | {x} | {gs:.0f} | {ps:.0f} |")
    print("\nPass on Gloo, not on pycomm (reserved monitored_barrier tests left out):",
          "none" if not lost else "")
    for w, t, why in lost:
        print(f"- world {w}: {t}: {why}")
    print("\nPass on pycomm, not on Gloo:", "none" if not won else "")
    for w, t, why in won:
        print(f"- world {w}: {t} (gloo: {why})")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
