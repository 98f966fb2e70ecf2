"""The run's plot: train reward and held-out accuracy per step, from metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_plot(run_dir: Path) -> Path | None:
    """Plot reward and held-out accuracy per step from metrics.jsonl into plot.png (needs
    matplotlib; without it the run says so and writes no plot)."""
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
    ax.legend(loc="best")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
