"""Recovery time after kill -9: from the kill to each survivor's next
completed step on the shrunk communicator (pycomm.elastic.shrink).

Each trial forks a Store process and `--world` ranks running a stream of
checked 70001-element all-reduces; one random rank is killed at a random
moment; the survivors catch the CommError, call ``pycomm.elastic.shrink(comm)`` and go on.
Prints per trial the victim and the slowest survivor's time, then the median
and max over the trials (every result is checked: #wrong must be 0)::

    python benchmarks/recovery.py --trials 20 --world 4
    python benchmarks/recovery.py --trials 20 --world 4 --local-size 2   # 2 simulated hosts x 2 ranks
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import elastic_cases as ec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--local-size", type=int, default=None, help="simulate hosts of this many ranks")
    args = ap.parse_args()
    kwargs = dict(local_size=args.local_size) if args.local_size else {}
    worst, wrong = [], 0
    for i in range(args.trials):
        res = ec.kill_and_shrink(args.world, 9000 + i, 20, kwargs)
        reps = [r for r in res["reports"].values() if r]
        wrong += sum(r["wrong"] for r in reps) + res["hung"] + len(res["leaked"])
        t = max(r["since_kill_s"] for r in reps)
        worst.append(t)
        print(f"trial {i + 1}: rank {res['victim']} killed; slowest survivor's next step {t * 1e3:.1f} ms after "
              f"the kill; survivors {reps[0]['members']}", flush=True)
    print(f"kill -9 to the next completed step, {args.world} ranks"
          f"{f' ({args.world // args.local_size} hosts)' if args.local_size else ''}, {args.trials} trials: median "
          f"{statistics.median(worst) * 1e3:.1f} ms, max {max(worst) * 1e3:.1f} ms; #wrong/hung/leaked {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
