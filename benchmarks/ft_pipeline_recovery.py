"""Recovery of pipeline x data-parallel training after kill -9
(pycomm.elastic.FaultTolerantPipeline): 2 replicas of a 2-rank pipeline
(4 ranks, the MLP of tests/ft_pipeline_cases.py), one rank killed at a
random step and moment, a replacement that joins. Recovery = the kill to
the next step that every rank of the other replica completed (the failed
step redone by that replica alone); checked in every trial: every stage
bitwise identical on every replica at every step, the replacement replica
admitted, nothing hung.

Example::

    python benchmarks/ft_pipeline_recovery.py --trials 10 --schedule 1f1b
    python benchmarks/ft_pipeline_recovery.py --trials 10 --local-size 2   # replica r on simulated host r
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ft_pipeline_cases as fp  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--local-size", type=int, default=None)
    args = ap.parse_args()
    fp.preload()
    rec, bad = [], []
    for trial in range(args.trials):
        res = fp.train(args.schedule, steps=args.steps, failure="kill", seed=100 + trial, local_size=args.local_size)
        ok = (res["hung"] == 0 and not res["split"] and res["recovery"] is not None
              and sorted(v for u, v in res["ends"].items() if u != res["victim"]) == ["done"] * 4)
        (rec if ok else bad).append(res["recovery"] if ok else res)
        print(f"trial {trial}: victim {res['victim']} after step {res['at_step']}: "
              + (f"recovery {res['recovery'] * 1e3:.0f} ms" if ok else f"FAILED {res['ends']} {res['why']}"),
              flush=True)
    if rec:
        rec.sort()
        print(f"pipeline recovery ({args.schedule}, 2 replicas x 2 stages"
              + (f", local size {args.local_size}" if args.local_size else ", one host")
              + f"): min {rec[0] * 1e3:.0f} / median {statistics.median(rec) * 1e3:.0f} / max {rec[-1] * 1e3:.0f} ms"
              f" over {len(rec)} trials; {len(bad)} failed")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
