"""One pycomm-bench sweep in K fresh launches: min / median / max per point.

A figure can change from one fresh process to the next (cache and page
placement, where the scheduler puts the ranks): this runs the same sweep K
times, each a new `python -m pycomm.bench` process, and reports per size and
algorithm the min / median / max of algbw over the launches, and each launch's
figure, so that slow launches show. Every point's #wrong must be 0::

    python benchmarks/launch_spread.py --launches 8 -- -b 1K -e 64M -f 4 --no-baseline

With ``--deepspeed`` it also prints, per size and pycomm algorithm, DeepSpeed's
time over pycomm's in the same launch (above 1: pycomm faster), so that the
worst launch is judged against DeepSpeed in the same processes::

    python benchmarks/launch_spread.py --launches 12 -- -b 1K -e 64M -f 4 -a auto --no-baseline --deepspeed

With ``--registered`` rows it also prints, per size and algorithm, the
registered call's speed-up over the unregistered one measured in the same
launch (min / median / max over launches: the worst launch included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_launches import launch  # noqa: E402

from pycomm.bench.report import format_size  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--checkout", default=".", help="root of the checkout to run (its own build)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then pycomm-bench options")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]

    bw: Dict[Tuple[int, str, str], List[float]] = {}
    us: Dict[Tuple[int, str, str], List[float]] = {}
    wrong = 0
    ratios: Dict[Tuple[int, str], List[float]] = {}
    vs_ds: Dict[Tuple[int, str], List[float]] = {}
    for i in range(args.launches):
        rows = launch(args.checkout, bench_args)
        times = {(r["size_bytes"], r["label"]): r["time_us"] for r in rows if r["backend"] == "pycomm"}
        for (size, label), t in times.items():
            if label.endswith("+reg") and (size, label[:-4]) in times:
                ratios.setdefault((size, label[:-4]), []).append(times[(size, label[:-4])] / t)
        for row in rows:
            if row["backend"] == "deepspeed":
                for (size, label), t in times.items():
                    if size == row["size_bytes"]:
                        vs_ds.setdefault((size, label), []).append(row["time_us"] / t)
        for row in rows:
            key = (row["size_bytes"], row["backend"], row["label"])
            wrong += row["wrong"]
            bw.setdefault(key, []).append(row["algbw_gbps"])
            us.setdefault(key, []).append(row["time_us"])
        print(f"# launch {i + 1}/{args.launches} done", file=sys.stderr, flush=True)

    print("| size | backend | algorithm | time µs min / median / max | algbw GB/s min / median / max | algbw per launch |")
    print("| ---: | --- | --- | ---: | ---: | --- |")
    for key in sorted(bw):
        size, backend, label = key
        b, t = bw[key], us[key]
        print(f"| {format_size(size)} | {backend} | {label} | {min(t):.1f} / {statistics.median(t):.1f} / {max(t):.1f} | "
              f"{min(b):.2f} / {statistics.median(b):.2f} / {max(b):.2f} | {' '.join(f'{x:.1f}' for x in b)} |")
    if ratios:
        print()
        print("| size | algorithm | registered speed-up, same launch: min / median / max | per launch |")
        print("| ---: | --- | ---: | --- |")
        for (size, label), r in sorted(ratios.items()):
            print(f"| {format_size(size)} | {label} | {min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f} | "
                  f"{' '.join(f'{x:.2f}' for x in r)} |")
    if vs_ds:
        print()
        print("| size | algorithm | DeepSpeed time / pycomm time, same launch: min / median / max | per launch |")
        print("| ---: | --- | ---: | --- |")
        for (size, label), r in sorted(vs_ds.items()):
            print(f"| {format_size(size)} | {label} | {min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f} | "
                  f"{' '.join(f'{x:.2f}' for x in r)} |")
    print(f"#wrong over every launch: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
