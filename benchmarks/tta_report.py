"""The report of benchmarks/time_to_accuracy.py: time to a target loss from
the saved runs' evaluation curves, the table per link rate (min / median /
max over fresh launches), the verdict against the issue's criterion (pycomm's
best against torch's best, and pycomm's best within 1 % of DDP's final
loss), and the plot of held-out loss against wall clock.

A run is what one launch's rank 0 saved: ``{"args", "params", "world",
"rows"}``, each row a config's step time, bytes, final loss and curve of
``(step, seconds, loss)``.
"""
from __future__ import annotations

import os
import statistics
from typing import Dict, List, Optional, Sequence


def first_under(curve: List, target: float) -> Optional[tuple]:
    """(step, seconds) of the first evaluation at or under ``target``, or None."""
    return next(((step, t) for step, t, loss in curve if loss <= target), None)


def is_torch(config: str) -> bool:
    """Whether a config is torch's own (no hook or one of torch's hooks)."""
    return config == "ddp" or config.startswith("torch-")


def retarget(run: Dict, target: float) -> None:
    """Time and step to ``target`` again, from a run's evaluation curve."""
    run["args"]["target"] = target
    for r in run["rows"]:
        hit = first_under(r["curve"], target)
        r["steps_to_target"], r["time_to_target_s"] = hit if hit else (None, None)


def verdict(by: Dict[str, List[Dict]], configs: List[str], base_loss: Optional[float]) -> List[str]:
    """Lines that compare torch's best config (by median time to target; no
    hook included) with pycomm's best, and with pycomm's best among those whose
    median final loss is within 1 % of DDP's (the issue's criterion)."""
    def med_time(c):
        t = [r["time_to_target_s"] for r in by[c]]
        return statistics.median(t) if None not in t else float("inf")

    ours = [c for c in configs if not is_torch(c)]
    theirs = [c for c in configs if is_torch(c)]
    if not ours or not theirs:
        return []
    torch_best = min(theirs, key=med_time)
    picks = [("pycomm's best", min(ours, key=med_time))]
    if base_loss:
        close = [c for c in ours if statistics.median(r["final_loss"] for r in by[c]) <= base_loss * 1.01]
        if close:
            picks.append(("pycomm's best with final loss within 1 % of ddp", min(close, key=med_time)))
    lines = []
    for label, best in picks:
        ratios = []
        for a, b in zip(by[torch_best], by[best]):
            a, b = a["time_to_target_s"], b["time_to_target_s"]
            ratios.append(f"{a / b:.2f}x" if a and b else "-")
        lines.append(f"- torch's best: {torch_best}; {label}: {best}; time-to-target ratio per launch: "
                     + ", ".join(ratios))
    return lines + [""]


def summarize(runs: Dict[str, List[Dict]], out: str, order: Sequence[str]) -> str:
    """The table per rate (min / median / max over launches), configs in
    ``order`` (unknown ones last), and the plot (time_to_accuracy.png in ``out``)."""
    known = list(order)
    lines = []
    for rate, launches in runs.items():
        configs = [r["config"] for r in sorted(launches[0]["rows"], key=lambda r: known.index(r["config"])
                                               if r["config"] in known else len(known))]
        by = {c: [next(r for r in run["rows"] if r["config"] == c) for run in launches] for c in configs}

        def spread(vals, fmt):
            if any(v is None for v in vals):
                return "not reached in " + str(sum(v is None for v in vals)) + "/" + str(len(vals))
            v = sorted(vals)
            return " / ".join(fmt.format(x) for x in (v[0], statistics.median(v), v[-1]))

        base_loss = statistics.median(r["final_loss"] for r in by["ddp"]) if "ddp" in by else None
        target = launches[0]["args"]["target"]
        lines += [f"### {rate}, {len(launches)} fresh launches, target loss {target}", "",
                  "| config | time to target (s), min / median / max | step (ms), median | MB per step | "
                  "final loss, median | vs ddp |", "| --- | --- | ---: | ---: | ---: | ---: |"]
        for c in configs:
            step = statistics.median(r["step_ms"] for r in by[c])
            mb = [r["bytes_per_step"] for r in by[c]]
            mbs = f"{statistics.median(mb) / 1e6:.3f}" if None not in mb else "-"
            loss = statistics.median(r["final_loss"] for r in by[c])
            rel = f"{(loss / base_loss - 1) * 100:+.1f} %" if base_loss else "-"
            lines.append(f"| {c} | {spread([r['time_to_target_s'] for r in by[c]], '{:.1f}')} | {step:.1f} | "
                         f"{mbs} | {loss:.4f} | {rel} |")
        lines.append("")
        lines += verdict(by, configs, base_loss)
    text = "\n".join(lines)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 5), squeeze=False)
        for ax, (rate, launches) in zip(axes[0], runs.items()):
            for r in launches[0]["rows"]:
                ax.plot([p[1] for p in r["curve"]], [p[2] for p in r["curve"]], label=r["config"],
                        linestyle="--" if is_torch(r["config"]) else "-")
            ax.axhline(launches[0]["args"]["target"], color="grey", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel("wall clock (s)")
            ax.set_ylabel("held-out loss (nats / char)")
            ax.set_title(f"4 hosts at {rate}, launch 1")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "time_to_accuracy.png"), dpi=110)
    except ImportError:
        pass
    return text


def write_summary(text: str, out: str) -> int:
    """The summary (summary.md in ``out``) written and printed."""
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0
