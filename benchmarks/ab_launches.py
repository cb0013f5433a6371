"""Before / after: one pycomm-bench sweep in fresh launches of two checkouts, alternating.

A change that must not slow anything down is checked side by side: each
launch is a fresh `python -m pycomm.bench` process run from one checkout's
root (its own build), alternating before, after, before, ... so that both
see the same machine noise. Prints, per point, min / median / max of the
time over the launches of each checkout and the ratio of the medians, then
the geometric mean of the ratios; every point's #wrong must be 0::

    python benchmarks/ab_launches.py --before ../old --after . --launches 5 -- -b 1K -e 16M -f 16 -a c10d --no-baseline
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

from pycomm.bench.report import format_size


def launch(checkout: str, bench_args: List[str]) -> List[dict]:
    """One fresh pycomm-bench process from `checkout`; its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), TORCH_CPP_LOG_LEVEL="ERROR")
        p = subprocess.run([sys.executable, "-m", "pycomm.bench", *bench_args, "--json", out],
                           cwd=os.path.abspath(checkout), env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"pycomm-bench failed in {checkout}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        with open(out) as f:
            data = json.load(f)
    rows = data["rows"] if isinstance(data, dict) else data
    if len({r.get("collective") for r in rows}) > 1:
        # Rows are compared by size and label, which several collectives share.
        raise SystemExit("give pycomm-bench one collective (-c NAME): its rows are compared by size and algorithm")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="root of the checkout built before the change")
    ap.add_argument("--after", required=True, help="root of the checkout built with the change")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then pycomm-bench options")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]

    times: Dict[str, Dict[Tuple[int, str], List[float]]] = {"before": {}, "after": {}}
    wrong = 0
    for i in range(args.launches):
        for side, root in (("before", args.before), ("after", args.after)):
            for row in launch(root, bench_args):
                if row["backend"] != "pycomm":
                    continue
                wrong += row["wrong"]
                times[side].setdefault((row["size_bytes"], row["label"]), []).append(row["time_us"])
            print(f"# launch {i + 1}/{args.launches} {side} done", file=sys.stderr, flush=True)

    def cell(v: List[float]) -> str:
        return f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"

    print("| size | algorithm | before: µs min / median / max | after: µs min / median / max | after/before (median) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    ratios = []
    for key in sorted(times["after"]):
        if key not in times["before"]:
            continue
        b, a = times["before"][key], times["after"][key]
        r = statistics.median(a) / statistics.median(b)
        ratios.append(r)
        print(f"| {format_size(key[0])} | {key[1]} | {cell(b)} | {cell(a)} | {r:.2f} |")
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    print(f"Geometric mean of the median ratios: {gm:.3f} (range {min(ratios):.2f}..{max(ratios):.2f}); "
          f"#wrong over every launch: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
