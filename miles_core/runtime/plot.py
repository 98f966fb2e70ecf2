"""The run's plot: train reward, held-out accuracy and held-out loss per step, from
metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_plot(run_dir: Path) -> Path | None:
    """Plot reward, held-out accuracy and (on a second axis, when measured) held-out loss per
    step from metrics.jsonl into plot.png (needs matplotlib; without it the run says so and
    writes no plot)."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    # A resumed run logs again the steps after its checkpoint: the last row of a step wins.
    trained = {r["step"]: r for r in rows if "reward/mean" in r}
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    reward = [(k, r["reward/mean"]) for k, r in sorted(trained.items())]
    acc = [(k, r["eval/accuracy"], r.get("eval/stderr", 0.0)) for k, r in sorted(evals.items())]
    losses = sorted({r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}.items())
    fig, ax = plt.subplots(figsize=(7, 4))
    if reward:
        ax.plot(*zip(*reward, strict=True), marker=".", label="train reward (mean)")
    if acc:
        steps, values, errors = zip(*acc, strict=True)
        ax.errorbar(
            steps, values, yerr=errors, marker="o", capsize=3, label="held-out accuracy (greedy)"
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if losses:
        right = ax.twinx()
        right.plot(*zip(*losses, strict=True), "s--", color="tab:red", label="held-out loss")
        right.set_ylabel("held-out loss (NLL per token)")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, loc="best")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
