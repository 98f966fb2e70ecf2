"""On-policy distillation vs GRPO: held-out steps to a significant gain from the same start.

    .venv/bin/python benchmarks/opd_vs_grpo.py [--steps 16] [--eval-every 2]

Both runs start from SmolLM2-135M-Instruct on the main job's task (reasoning-gym chain_sum,
``examples/main.yaml``: 8 groups of 4 samples a step, 48 new tokens, lr 2e-5, the embedded CPU
engine and the FSDP2 trainer), and are evaluated on the main job's 100 held-out problems
(greedy) before training and every ``--eval-every`` steps.

1. GRPO: the main job itself, exported at the end (``run.export``): its trained policy is the
   teacher.
2. On-policy distillation (``examples/opd.yaml``): the same base model as the student, the
   teacher served by its own embedded engine, scoring every sampled token; the loss is the
   per-token reverse KL to the teacher. Same data, seed, batch and learning rate.

For each run, the steps to a significant gain are those of the first evaluation whose accuracy
exceeds the start's by more than 2 standard errors of the difference (``sqrt(p0 (1 - p0) / n +
p (1 - p) / n)``, n = 100). The last line is JSON: ``steps_ratio`` (distillation's steps over
GRPO's; below 1: distillation needed fewer), both curves, the teacher's accuracy, and each
run's median step time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import describe

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path("~/.cache/miles/models/SmolLM2-135M-Instruct").expanduser()


def ensure_model() -> None:
    """The Hugging Face folder of SmolLM2 (from the shipped GGUF) and its verified family."""
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "miles_modelfamilies.smollm2_model"], check=True)
    cli = Path(sys.executable).with_name("miles")
    subprocess.run([str(cli), "family", "verify", "smollm2"], check=True, stdout=subprocess.DEVNULL)


def train(config: str, name: str, work: Path, steps: int, every: int, *extra: str) -> Path:
    """``miles train`` of ``config`` as run ``name`` under ``work``; returns the run's folder.
    Its progress goes to this script's stderr."""
    cli = Path(sys.executable).with_name("miles")
    cmd = [
        str(cli), "train", str(ROOT / config),
        "--set", f"run.name={name}",
        "--set", f"run.output_dir={work}",
        "--set", f"run.steps={steps}",
        "--set", f"eval.every={every}",
        "--set", "run.checkpoint_every=0",
        *extra,
    ]  # fmt: skip
    print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr)
    return work / name


def curve(run: Path) -> tuple[list[list[float]], int]:
    """The run's held-out accuracy per evaluated step, and the number of problems."""
    summary = json.loads((run / "eval.json").read_text())
    return summary["history"], int(summary.get("n_heldout", 100))


def steps_to_gain(history: list[list[float]], n: int) -> int | None:
    """The first evaluated step whose accuracy beats the start's by more than 2 standard errors
    of the difference; ``None`` when none does."""
    p0 = history[0][1]
    for step, p in history[1:]:
        se = math.sqrt(p0 * (1 - p0) / n + p * (1 - p) / n)
        if p - p0 > 2 * se:
            return int(step)
    return None


def median_step_s(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["time/step_s"] for r in rows if "time/step_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=2)
    args = parser.parse_args()
    describe({"steps": args.steps, "eval_every": args.eval_every, "model": str(MODEL)})
    ensure_model()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-opd-bench-") as tmp:
        work = Path(tmp)
        every = args.eval_every
        export = ("--set", "run.export=true")
        grpo = train("examples/main.yaml", "grpo", work, args.steps, every, *export)
        opd = train(
            "examples/opd.yaml",
            "opd",
            work,
            args.steps,
            every,
            "--set",
            f"teacher.path={grpo / 'model'}",
        )
        grpo_curve, n = curve(grpo)
        opd_curve, _ = curve(opd)
        grpo_steps, opd_steps = steps_to_gain(grpo_curve, n), steps_to_gain(opd_curve, n)
        result: dict[str, Any] = {
            "steps_ratio": (round(opd_steps / grpo_steps, 3) if grpo_steps and opd_steps else None),
            "opd_steps_to_2se": opd_steps,
            "grpo_steps_to_2se": grpo_steps,
            "teacher_accuracy": grpo_curve[-1][1],
            "grpo_curve": grpo_curve,
            "opd_curve": opd_curve,
            "n_heldout": n,
            "grpo_step_s": round(median_step_s(grpo), 2),
            "opd_step_s": round(median_step_s(opd), 2),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        if grpo_steps is None or opd_steps is None:
            missing = [k for k, v in (("grpo", grpo_steps), ("opd", opd_steps)) if v is None]
            result["note"] = (
                f"{' and '.join(missing)} did not gain 2 SE within {args.steps} steps: no ratio"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
