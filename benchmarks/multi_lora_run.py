"""Multi-LoRA RL: two LoRA adapters trained on one base in one run, each on its own task, and
what a step costs against training one adapter on the same total batch.

    .venv/bin/python benchmarks/multi_lora_run.py [--steps 16] [--eval-every 4] [--no-single]

1. ``examples/multi_lora.yaml``: SmolLM2-135M-Instruct with two rank-8 adapters, ``chain_sum``
   (the main job's task) and ``products`` (one-digit products), 8 groups of 4 samples of each
   a step (one rollout batch mixes them), GRPO, lr 2e-4, the embedded CPU engine, FSDP2 and the
   colocated transport. Each adapter is evaluated on its own 100 held-out problems (greedy)
   before training and every ``--eval-every`` steps.
2. Unless ``--no-single``: the main job with one adapter on the same total batch (16 groups a
   step, lr 2e-4), for the step time of one adapter against two.

The last line is JSON: each adapter's accuracy before and after and its gain in standard errors
of the difference (``<name>_gain_se``; the goal: both > 2), the steps to a gain of more than 2,
``two_over_one_step_time`` (median step time, two adapters over one) and the median bytes and
seconds of the weight sync.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _machine import describe
from lora_vs_full import gain_se, median_metric
from opd_vs_grpo import MODEL, ensure_model, median_step_s, steps_to_gain, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--no-single", action="store_true")
    args = parser.parse_args()
    describe({"steps": args.steps, "eval_every": args.eval_every, "model": str(MODEL)})
    ensure_model()
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="miles-multi-lora-bench-") as tmp:
        work = Path(tmp)
        run = train("examples/multi_lora.yaml", "multi", work, args.steps, args.eval_every)
        summary = json.loads((run / "eval.json").read_text())
        for name, adapter in summary["adapters"].items():
            history, n = adapter["history"], int(adapter["n_heldout"])
            result[f"{name}_before"] = history[0][1]
            result[f"{name}_after"] = history[-1][1]
            result[f"{name}_gain_se"] = gain_se(history, n)
            result[f"{name}_steps_to_2se"] = steps_to_gain(history, n)
            result[f"{name}_curve"] = history
            result["n_heldout"] = n
        result["two_step_s"] = round(median_step_s(run), 2)
        result["two_sync_s"] = round(median_metric(run, "sync/seconds"), 3)
        result["two_sync_bytes"] = median_metric(run, "sync/bytes")
        if not args.no_single:
            one = train(
                "examples/main.yaml", "one", work, args.steps, 0,
                "--set", "adapter.name=lora",
                "--set", "engine.enable_lora=true",
                "--set", "backend.lr=2e-4",
                "--set", "rollout.groups_per_step=16",
            )  # fmt: skip
            result["one_step_s"] = round(median_step_s(one), 2)
            result["two_over_one_step_time"] = round(result["two_step_s"] / result["one_step_s"], 3)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
