"""The last line of ``scripts/agent_job.sh``: held-out task success of the warm start and after
RL, with standard errors, and the run's checks that every episode's stored tokens are the
engine's (TITO)::

    python -m miles_env_calculator.report --sft SFT_LINE --rl RL_LINE --seconds N

``SFT_LINE`` and ``RL_LINE`` are the final JSON lines of the two ``miles train`` runs. The RL
run's evaluation before its first step is the warm start's success (the same agent, greedy,
on the same held-out tasks), its evaluation after the last step the trained policy's.

The token check reads the RL run's ``metrics.jsonl``: the ``session`` rollout holds every
stored turn of every episode against the engine's own generations (its context, every stored
token before the reply, must be a generation's input ids and its reply that generation's
output ids), counted per step as ``counts/tito_turns`` and ``counts/tito_mismatches``.
``tito_ok`` is no mismatch over turns checked. ``train/mismatch/abs_mean`` (the trainer's
log-probs of the stored tokens against the engine's) is reported beside it: on the fully
asynchronous schedule it also holds the distance between the policy that sampled a token and
the one that trains on it, so it is not the check. ``counts/non_canonical_turns`` counts the
turns whose generated tokens differ from the canonical tokenization of their text, kept as
generated.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def stderr(accuracy: float, n: int) -> float:
    """The standard error of a success rate over ``n`` tasks."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / max(n, 1))


def token_checks(metrics_path: Path) -> dict[str, Any]:
    """The TITO figures of a run's ``metrics.jsonl`` (see the module docstring)."""
    means: list[float] = []
    counts = dict.fromkeys(
        (
            "tito_turns",
            "tito_mismatches",
            "non_canonical_turns",
            "merged_boundaries",
            "malformed_tool_calls",
        ),
        0.0,
    )
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        if "train/mismatch/abs_mean" in row:
            means.append(float(row["train/mismatch/abs_mean"]))
        for name in counts:
            counts[name] += float(row.get(f"counts/{name}", 0.0))
    return {
        "tito_ok": counts["tito_turns"] > 0 and counts["tito_mismatches"] == 0,
        **{k: int(v) for k, v in counts.items()},
        "mismatch_abs_mean_max": max(means) if means else None,
    }


def summarize(sft: Mapping[str, Any], rl: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """The job's figures from the two runs' final lines."""
    n = int(rl["n_heldout"])
    before, after = float(rl["accuracy_before"]), float(rl["accuracy_after"])
    se_before, se_after = stderr(before, n), stderr(after, n)
    se_diff = math.sqrt(se_before**2 + se_after**2)
    gain = after - before
    return {
        "success_before": before,
        "success_after": after,
        "n_heldout": n,
        "stderr_before": se_before,
        "stderr_after": se_after,
        "improvement": gain,
        "improvement_in_stderr": gain / se_diff if se_diff > 0 else None,
        "improved_by_2_stderr": se_diff > 0 and gain > 2 * se_diff,
        "rl_steps": rl.get("steps"),
        **token_checks(Path(rl["run_dir"]) / "metrics.jsonl"),
        "sft_run_dir": sft.get("run_dir"),
        "rl_run_dir": rl["run_dir"],
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    """Command line: print the job's final JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT run's final JSON line")
    parser.add_argument("--rl", required=True, help="the RL run's final JSON line")
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(summarize(json.loads(args.sft), json.loads(args.rl), args.seconds)))


if __name__ == "__main__":
    main()
