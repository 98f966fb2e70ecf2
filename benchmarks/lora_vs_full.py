"""LoRA RL against full fine-tuning: the main job's held-out gain and its step time, with and
without ``adapter: lora``, measured one after the other in one run.

    .venv/bin/python benchmarks/lora_vs_full.py [--steps 16] [--eval-every 4] [--lora-lr 2e-4]

Both runs are the main job (``examples/main.yaml``: SmolLM2-135M-Instruct on reasoning-gym
chain_sum, 8 groups of 4 samples a step, GRPO, the embedded CPU engine, FSDP2, the colocated
transport) from the same start, evaluated on its 100 held-out problems (greedy) before training
and every ``--eval-every`` steps:

1. full fine-tuning, as the main job is (lr 2e-5);
2. the same with ``adapter: {name: lora}`` (r 8, alpha 16, every attention and MLP projection),
   the engine started with ``enable_lora``, lr ``--lora-lr``: the trainer trains the adapter
   alone and the transport publishes the adapter alone.

The last line is JSON: each run's accuracy before and after and its gain in standard errors of
the difference (``sqrt(p0 (1 - p0) / n + p (1 - p) / n)``), the steps to a gain of more than 2,
``lora_over_full_step_time`` (median step time, LoRA over full), the median seconds of each
weight sync, and both curves.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import describe
from opd_vs_grpo import MODEL, curve, ensure_model, median_step_s, steps_to_gain, train


def gain_se(history: list[list[float]], n: int) -> float:
    """The last evaluation's gain over the first, in standard errors of the difference."""
    p0, p = history[0][1], history[-1][1]
    se = math.sqrt(p0 * (1 - p0) / n + p * (1 - p) / n)
    return round((p - p0) / se, 2) if se else 0.0


def median_metric(run: Path, key: str) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r[key] for r in rows if key in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    args = parser.parse_args()
    describe(
        {"steps": args.steps, "eval_every": args.eval_every, "lora_lr": args.lora_lr,
         "model": str(MODEL)}
    )  # fmt: skip
    ensure_model()
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-lora-bench-") as tmp:
        work = Path(tmp)
        runs = {
            "full": train("examples/main.yaml", "full", work, args.steps, args.eval_every),
            "lora": train(
                "examples/main.yaml", "lora", work, args.steps, args.eval_every,
                "--set", "adapter.name=lora",
                "--set", "engine.enable_lora=true",
                "--set", f"backend.lr={args.lora_lr}",
            ),
        }  # fmt: skip
        for side, run in runs.items():
            history, n = curve(run)
            result[f"{side}_before"] = history[0][1]
            result[f"{side}_after"] = history[-1][1]
            result[f"{side}_gain_se"] = gain_se(history, n)
            result[f"{side}_steps_to_2se"] = steps_to_gain(history, n)
            result[f"{side}_step_s"] = round(median_step_s(run), 2)
            result[f"{side}_sync_s"] = round(median_metric(run, "sync/seconds"), 3)
            result[f"{side}_sync_bytes"] = median_metric(run, "sync/bytes")
            result[f"{side}_curve"] = history
            result["n_heldout"] = n
    result["lora_over_full_step_time"] = round(result["lora_step_s"] / result["full_step_s"], 3)
    result["full_over_lora_sync_bytes"] = round(
        result["full_sync_bytes"] / result["lora_sync_bytes"], 1
    )
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
