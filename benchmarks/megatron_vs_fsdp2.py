"""Megatron-core backend vs FSDP2 backend: train samples/s on the same work, in one run.

    .venv/bin/python benchmarks/megatron_vs_fsdp2.py [--steps 4] [--model PATH] [--quick]

The work: GRPO train steps (the ``grpo`` algorithm's defaults: the engine's log-probs as the
behaviour policy, no recompute) on SmolLM2-135M-Instruct in fp32 on the CPU, one rank each
(tensor, pipeline, data parallel 1: where parallelism does not help, the two backends should
cost the same). A batch is 8 groups of 4 samples: the prompt is a reasoning-gym chain_sum
question through the SmolLM2 chat template (as in the main job), the responses random tokens
of 8 to 48 tokens (a train step's cost does not depend on which tokens they are), rewards 0 or
1. Both backends train the same batches with the same options (lr 2e-5, gradient norm clipped
at 1.0, micro-batch budget 8192 tokens, activations kept).

FSDP2 is measured twice: with its default ``share_prompts`` (a group's prompt forwarded once
for its 4 responses; Megatron's rotary embedding takes no per-token positions, so the Megatron
backend forwards one sequence per sample) and without it (the same tokens as Megatron). The
steps alternate between the backends (FSDP2, FSDP2 without sharing, Megatron, again), after
one warm-up step each, so the machine's noise falls on all of them alike; each side's time is
the median of its steps.

The last line is JSON: ``megatron_over_fsdp2`` (Megatron samples/s over FSDP2's with its
defaults), ``megatron_over_fsdp2_unshared``, each side's median step time, the settings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _machine import describe

MODEL = Path("~/.cache/miles/models/SmolLM2-135M-Instruct").expanduser()
GROUPS, GROUP_SIZE = 8, 4


def make_batches(model: Path, steps: int, seed: int = 0) -> list[list[Any]]:
    """``steps`` batches of chat-templated chain_sum prompts with random responses."""
    from transformers import AutoTokenizer

    from miles_core.builtins.reasoning_gym import ReasoningGymOptions, ReasoningGymSource
    from miles_core.data import Group, Sample

    tokenizer = AutoTokenizer.from_pretrained(model)
    source = ReasoningGymSource(
        ReasoningGymOptions(
            task="chain_sum",
            size=1000,
            seed=1,
            task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
            prompt_suffix=" Reply with only the final number.",
        )
    )
    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        groups = []
        for g in range(GROUPS):
            record = source.record(step * GROUPS + g)
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": record["prompt"]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            samples = []
            for i in range(GROUP_SIZE):
                s = Sample(prompt_ids=list(prompt))
                n = rng.randint(8, 48)
                s.append(
                    [rng.randrange(10, tokenizer.vocab_size) for _ in range(n)],
                    logprobs=[-1.0] * n,
                    version=0,
                )
                s.reward = float((i + g + step) % 2)
                samples.append(s)
            groups.append(Group(samples=samples, prompt=record))
        batches.append(groups)
    return batches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per side")
    p.add_argument("--model", default=str(MODEL), help="Hugging Face folder of the model")
    p.add_argument("--quick", action="store_true", help="1 measured step (a smoke run)")
    args = p.parse_args()
    steps = 1 if args.quick else args.steps
    import torch
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build as build_fsdp2
    from miles_backend_megatron.options import MegatronOptions
    from miles_backend_megatron.trainer import build as build_megatron

    threads = torch.get_num_threads()
    common = {"lr": 2e-5, "max_grad_norm": 1.0, "micro_batch_tokens": 8192, "cpu_threads": threads}
    describe({"steps": steps, "model": args.model, **common})
    model = Path(args.model).expanduser()
    if not (model / "config.json").is_file():
        import subprocess

        subprocess.run([sys.executable, "-m", "miles_modelfamilies.smollm2_model"], check=True)
    batches = make_batches(model, steps + 1)
    algo = build_policy_gradient(GRPOOptions())
    sides: dict[str, Any] = {
        "fsdp2": build_fsdp2(FSDP2Options(**common)),
        "fsdp2_unshared": build_fsdp2(FSDP2Options(**common, share_prompts=False)),
        "megatron": build_megatron(MegatronOptions(**common)),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for trainer in sides.values():
        trainer.setup(str(model))
    for i, groups in enumerate(batches):
        for name, trainer in sides.items():
            t0 = time.perf_counter()
            trainer.train_step(groups, algo)
            elapsed = time.perf_counter() - t0
            if i > 0:  # the first step of each side warms up
                times[name].append(elapsed)
            print(f"step {i} {name}: {elapsed:.2f}s{' (warm-up)' if i == 0 else ''}", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    samples = GROUPS * GROUP_SIZE
    result = {
        "steps": steps,
        "samples_per_step": samples,
        **{f"{name}_median_step_s": round(v, 3) for name, v in median.items()},
        **{f"{name}_samples_per_s": round(samples / v, 3) for name, v in median.items()},
        "megatron_over_fsdp2": round(median["fsdp2"] / median["megatron"], 3),
        "megatron_over_fsdp2_unshared": round(median["fsdp2_unshared"] / median["megatron"], 3),
    }
    for trainer in sides.values():
        trainer.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
