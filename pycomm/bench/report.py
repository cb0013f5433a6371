"""Tables, JSON and plots of benchmark rows (nccl-tests' columns and factors)."""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from .._env import format_size

# nccl-tests' bus-bandwidth factors: the fraction of the data each rank's
# link must carry for the collective, so that busbw is comparable to the
# hardware's bandwidth whatever the rank count.
def busbw_factor(collective: str, nranks: int) -> float:
    return {
        "all_reduce": 2.0 * (nranks - 1) / nranks,
        "reduce_scatter": (nranks - 1) / nranks,
        "all_gather": (nranks - 1) / nranks,
        "all_to_all": (nranks - 1) / nranks,
        "broadcast": 1.0,
    }[collective]


HEADER = (
    f"{'size(B)':>12} {'count':>12} {'type':>9} {'redop':>6} {'algorithm':>26} |"
    f" {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} | {'vs base':>8}"
)


def format_row(row: Dict) -> str:
    speedup = row.get("speedup_vs_baseline")
    vs = f"{speedup:7.2f}x" if speedup else f"{'base' if row['backend'] not in ('pycomm', 'memcpy') else '-':>8}"
    return (
        f"{row['size_bytes']:>12} {row['count']:>12} {row['dtype']:>9} {row['op']:>6} {row['label']:>26} |"
        f" {row['time_us']:>10.1f} {row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f} {row['wrong']:>7} | {vs}"
    )


def summary(rows: List[Dict]) -> List[str]:
    """Per collective and size: the best exact pycomm algorithm and its ratio
    to the baseline, and the fastest compressed all-reduce (lossy: never
    called the best). Lines name their collective when the rows hold several."""
    lines = []
    colls = list(dict.fromkeys(r["collective"] for r in rows))
    for coll in colls:
        name = f"{coll} " if len(colls) > 1 else ""
        of_coll = [r for r in rows if r["collective"] == coll]
        for size in sorted({r["size_bytes"] for r in of_coll}):
            mine = [r for r in of_coll if r["size_bytes"] == size and r["backend"] == "pycomm"]
            base = [r for r in of_coll if r["size_bytes"] == size and r["backend"] not in ("pycomm", "memcpy")]
            exact = [r for r in mine if "compression" not in r]
            lossy = [r for r in mine if "compression" in r]
            for kind, group in (("best", exact), ("compressed", lossy)):
                if not group:
                    continue
                best = min(group, key=lambda r: r["time_us"])
                text = (f"{name}{format_size(size):>6}: {kind} {best['label']:<26} {best['time_us']:10.1f} us "
                        f"{best['algbw_gbps']:7.3f} GB/s algbw")
                if kind == "compressed":
                    text += f", {best['plain_bytes'] / max(best['wire_bytes'], 1):.1f}x fewer bytes sent"
                if base:
                    b = base[0]
                    text += (f"   {b['backend']} {b['time_us']:10.1f} us   "
                             f"speedup {b['time_us'] / best['time_us']:6.2f}x")
                lines.append(text)
    return lines


def write_json(rows: List[Dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def plot(rows: List[Dict], path: str, title: Optional[str] = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    for label in labels:
        pts = sorted((r["size_bytes"], r["busbw_gbps"], r["time_us"]) for r in rows if r["label"] == label)
        style = "k--" if any(r["backend"] != "pycomm" for r in rows if r["label"] == label) else "-o"
        ax_bw.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=3)
        ax_lat.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label, markersize=3)
    for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_lat, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.set_yscale("log")
    ax_bw.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
