"""The fully asynchronous loop against its pipelined limit and against the synchronous loop,
in one run on the same resources.

    .venv/bin/python benchmarks/async_rl.py [--quick] [--steps N]

Resources: one local Ray cluster of 2 logical CPUs; every run is placed ``disaggregated``:
the FSDP2 trainer in a Ray actor holding one CPU bundle (``MILES_RAY.trainer_cpus: 1``,
``cpu_threads: 1``: one torch thread), the embedded engine's server started by a Ray actor in
the other bundle (``ray_num_cpus: 1``, ``num_threads: 1``: one torch thread), weights synced
by gloo broadcast. The driver (this process) sets ``torch.set_num_threads(1)``; it only
schedules requests and scores them. So each side has one core of the 2-core machine, and
neither can borrow the other's when it idles, exactly as on separate device pools.

Work: a tiny random Qwen3 (vocabulary 512, hidden 64, 2 layers) with a long-tail workload:
random prompts of 8-24 tokens, each sample's ``max_new_tokens`` drawn from a Pareto(1.2)
distribution scaled by 6 and clipped to [4, 160] (EOS ignored, so every sample has exactly its
length); groups of 4, 8 groups per step; GRPO with the engine's log-probs as behaviour policy;
a reward that differs between samples (a hash of the tokens).

Measured, in order, samples/s (a sample = one trajectory generated, or trained on):

1. rollout only: the asynchronous loop's producer alone (no training), an unbounded buffer;
   the rate of finished groups after the first few;
2. train only: the same placement's trainer stepping on groups generated in (1), 8 groups a
   step, no weight sync;
   the pipelined limit is ``min(1, 2)``: what a perfect overlap of the two sides would reach;
3. the fully asynchronous loop (buffer of 16 groups, staleness bound 4, ``retract`` pauses),
   twice at the same bound: without admission control (every group a free slot allows starts,
   the trainer takes groups in arrival order, the discard at removal alone bounds staleness),
   then with it (``buffer.admission: true``: a group starts only when it can be taken within
   the bound given the groups ahead of it, oldest weights taken first);
4. the synchronous loop on the same placement (rollout, train, sync in turn);
5. the synchronous loop placed ``colocated``, as a user with one pool of cores would run it:
   the trainer (2 torch threads) and the engine's server (2 torch threads, its own process)
   take turns on both cores, weights synced over shared memory (``colocated`` transport).

The synchronous baseline is the better of (4) and (5), named in ``sync_best``;
``sync_over_limit`` is that one's rate over the limit. ``async_over_limit`` is the rate of (3)
with admission control over the limit, ``async_no_admission_over_limit`` the one without; the
stale drops of each (groups generated, then discarded at removal) and the admissions held
(count and seconds) are reported beside them. (3), (4) and (5) are timed from the end
of the first step to the end of the last (the first step includes start-up); a step trains 32
samples. The asynchronous run's own metrics (mean queue size, engine idle and paused
fractions, stale drops) are reported beside the rates.

Final line: JSON with ``async_over_limit``, ``sync_over_limit`` and every rate. Other work on
a shared machine takes CPU from both sides at once in (3) and (4) but from one side only in (1)
and (2), so a loaded machine lowers both ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import describe

GROUP, GROUPS_PER_STEP = 4, 8
VOCAB = 512


def make_model(path: Path) -> Path:
    """Save the tiny random Qwen3."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def write_prompts(path: Path, n: int) -> Path:
    """Prompt records: token ids and the long-tail length of each of the group's samples."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 24))]
            lengths = [min(160, max(4, int(6 * rng.paretovariate(1.2)))) for _ in range(GROUP)]
            f.write(json.dumps({"prompt": f"p{i}", "ids": ids, "lengths": lengths}) + "\n")
    return path


class Bench:
    """The benchmark's in-process plugin: the long-tail rollout, the reward, and timestamps of
    finished groups and emitted steps."""

    def __init__(self) -> None:
        self.finished: list[float] = []
        self.steps: list[float] = []


def build_plugin(bench: Bench) -> Any:
    """Make the plugin object (imports miles_core lazily, after the thread settings)."""
    from miles_core import RewardFunction, RolloutFunction, hookimpl
    from miles_core.data import Group, Sample

    async def longtail(
        prompt: dict[str, Any], *, group_size: int, engine: Any, reward: Any, **ctx: Any
    ) -> Group:
        params = dict(ctx.get("sampling_params") or {})
        calls = [
            engine.generate(
                prompt["ids"],
                {**params, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": 7 * k + 1},
            )
            for k, n in enumerate(prompt["lengths"][:group_size])
        ]
        samples = []
        for result in await asyncio.gather(*calls):
            reason = result.finish_reason if result.finish_reason in ("stop", "length") else "abort"
            sample = Sample(prompt_ids=list(prompt["ids"]), finish_reason=reason)
            sample.append(
                list(result.output_ids),
                logprobs=list(result.logprobs),
                version=int(result.weight_version or 0),
            )
            sample.reward = float(reward(sample, prompt))
            samples.append(sample)
        return Group(samples=samples, prompt=dict(prompt))

    class Plugin:
        @hookimpl
        def miles_register_rollout_functions(self, register: Any) -> None:
            register(RolloutFunction(name="longtail", factory=lambda options: longtail))

        @hookimpl
        def miles_register_reward_functions(self, register: Any) -> None:
            register(
                RewardFunction(
                    name="diversity",
                    factory=lambda options: lambda s, p: (sum(s.response_ids) % 1000) / 1000,
                )
            )

        @hookimpl
        def miles_group_finished(self, group: Any, step: int) -> None:
            bench.finished.append(time.perf_counter())

        @hookimpl
        def miles_metrics_emitted(self, step: int, metrics: Any) -> None:
            if "eval/accuracy" not in metrics:
                bench.steps.append(time.perf_counter())

    return Plugin()


def raw_config(
    tmp: Path,
    model: Path,
    data: Path,
    name: str,
    mode: str,
    steps: int,
    colocated: bool = False,
    admission: bool = False,
) -> dict:
    """The run config of one measurement (disaggregated on Ray, or colocated on both cores)."""
    raw = {
        "run": {
            "name": name,
            "output_dir": str(tmp / "runs"),
            "steps": steps,
            "mode": mode,
            "placement": "disaggregated",
        },
        "model": {"path": str(model)},
        "backend": {"name": "fsdp2", "lr": 1e-3, "cpu_threads": 1},
        "engine": {
            "name": "embedded",
            "max_running_requests": 16,
            "num_threads": 1,
            "context_length": 256,
            "launch_in": "ray_actor",
            "ray_num_cpus": 1,
        },
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": {"name": "broadcast", "bucket_size_mb": 16, "timeout_s": 120},
        "rollout_function": "longtail",
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": GROUP, "groups_per_step": GROUPS_PER_STEP},
        "buffer": {
            "capacity": 16,
            "max_staleness": 4,
            "on_drop": "discard",
            "admission": admission,
        },
        "metrics": {"sinks": ["jsonl"]},
    }
    if colocated:
        raw["run"]["placement"] = "colocated"
        raw["backend"]["cpu_threads"] = 2
        raw["engine"] = {
            **raw["engine"], "num_threads": 2, "launch_in": "process",
        }  # fmt: skip
        raw["transport"] = {"name": "colocated", "bucket_size_mb": 16}
    return raw


def plugins_with(bench: Bench) -> Any:
    """Every installed plugin plus the benchmark's own."""
    from miles_core.plugins import Plugins, collect_registry, create_plugin_manager

    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(build_plugin(bench), name="bench", distribution="bench", version="0")
    return Plugins(pm=pm, registry=collect_registry(pm))


def rollout_and_train_only(
    tmp: Path, model: Path, data: Path, warm: int, measure: int, train_steps: int
) -> tuple[float, float]:
    """(1) and (2) on one placement: the producer alone, then the trainer alone."""
    from miles_core.config import validate_config
    from miles_core.runtime import Run

    bench = Bench()
    plugins = plugins_with(bench)
    raw = raw_config(tmp, model, data, "parts", "async", 1)
    raw["buffer"] = {"capacity": 100_000, "max_staleness": 100_000}
    with Run(validate_config(raw, plugins.registry), plugins, progress="off") as run:
        schedule = run.schedule
        assert run.fleet is not None
        run.io(schedule.start(run.fleet.version))

        async def until(n: int) -> None:
            while len(bench.finished) < n:
                await asyncio.sleep(0.01)

        run.io(until(warm))
        t0, n0 = time.perf_counter(), len(bench.finished)
        run.io(until(warm + measure))
        rollout = (len(bench.finished) - n0) * GROUP / (time.perf_counter() - t0)
        needed = (train_steps + 1) * GROUPS_PER_STEP
        run.io(until(needed))
        groups = run.io(schedule.buffer.get_batch(needed, 0))
        run.io(schedule.stop())
        assert run.parts is not None
        trainer, algorithm = run.parts.trainer, run.parts.algorithm
        batches = [groups[i : i + GROUPS_PER_STEP] for i in range(0, needed, GROUPS_PER_STEP)]
        trainer.train_step(batches[0], algorithm)  # warm-up
        t0 = time.perf_counter()
        for batch in batches[1:]:
            trainer.train_step(batch, algorithm)
        train_rate = train_steps * GROUPS_PER_STEP * GROUP / (time.perf_counter() - t0)
    return rollout, train_rate


def loop_rate(
    tmp: Path,
    model: Path,
    data: Path,
    mode: str,
    steps: int,
    colocated: bool = False,
    admission: bool = False,
) -> tuple[float, dict[str, float]]:
    """(3), (4) or (5): samples/s from the end of the first step to the end of the last, and
    the run's mean producer metrics (steps 2 on) with its stale drops and admissions held
    (whole run), also printed to stderr."""
    from miles_core.config import validate_config
    from miles_core.runtime import Run, train

    bench = Bench()
    plugins = plugins_with(bench)
    name = f"{mode}-colocated" if colocated else mode
    if mode == "async":
        name = f"async-{'admission' if admission else 'no-admission'}"
    raw = raw_config(tmp, model, data, name, mode, steps, colocated=colocated, admission=admission)
    config = validate_config(raw, plugins.registry)
    train(Run(config, plugins, progress="off"))
    assert len(bench.steps) == steps, bench.steps
    every = [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").open()]
    every = [r for r in every if "eval/accuracy" not in r]
    rows = every[1:]
    keys = ("buffer/size", "rollout/idle_fraction", "rollout/paused_fraction")
    means = {k: round(sum(r.get(k, 0.0) for r in rows) / len(rows), 3) for k in keys}
    means["drops/stale"] = every[-1].get("drops/stale", 0.0)  # a count over the whole run
    means["produced"] = every[-1].get("ledger/produced", 0.0)
    for key in ("admission/held", "admission/held_s"):  # each step's window, summed
        means[key] = round(sum(r.get(key, 0.0) for r in every), 3)
    print(f"{name} run, steps 2-{steps}: {json.dumps(means)}", file=sys.stderr)
    rate = (steps - 1) * GROUPS_PER_STEP * GROUP / (bench.steps[-1] - bench.steps[0])
    return rate, means


def main() -> int:
    """Run the measurements; print the final JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and groups")
    parser.add_argument("--steps", type=int, default=None, help="steps of each loop run")
    args = parser.parse_args()
    steps = args.steps or (6 if args.quick else 12)
    describe({"steps": steps, "group": GROUP, "groups_per_step": GROUPS_PER_STEP, "ray_cpus": 2})
    import torch

    torch.set_num_threads(1)
    import ray

    os.environ["MILES_RAY"] = "{trainer_cpus: 1, ready_timeout_s: 120}"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
        _node_ip_address="127.0.1.1",  # a local cluster on loopback: its servers need no key
    )
    try:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            model = make_model(tmp / "model")
            data = write_prompts(tmp / "prompts.jsonl", 2000)
            rollout, train = rollout_and_train_only(
                tmp, model, data, warm=4, measure=steps * GROUPS_PER_STEP, train_steps=steps
            )
            limit = min(rollout, train)
            print(f"rollout only {rollout:.1f} samples/s, train only {train:.1f}", file=sys.stderr)
            no_admission, before = loop_rate(tmp, model, data, "async", steps)
            print(f"async loop, no admission {no_admission:.1f} samples/s", file=sys.stderr)
            asynchronous, after = loop_rate(tmp, model, data, "async", steps, admission=True)
            print(f"async loop, admission {asynchronous:.1f} samples/s", file=sys.stderr)
            synchronous, _ = loop_rate(tmp, model, data, "sync", steps)
            print(f"sync loop (disaggregated) {synchronous:.1f} samples/s", file=sys.stderr)
            sync_colocated, _ = loop_rate(tmp, model, data, "sync", steps, colocated=True)
            print(f"sync loop (colocated) {sync_colocated:.1f} samples/s", file=sys.stderr)
    finally:
        ray.shutdown()
    syncs = {"disaggregated": synchronous, "colocated": sync_colocated}
    best = max(syncs, key=syncs.__getitem__)
    print(
        json.dumps(
            {
                "async_over_limit": round(asynchronous / limit, 3),
                "async_no_admission_over_limit": round(no_admission / limit, 3),
                "stale_drops": after["drops/stale"],
                "stale_drops_no_admission": before["drops/stale"],
                "groups_produced": after["produced"],
                "groups_produced_no_admission": before["produced"],
                "admission_held": after["admission/held"],
                "admission_held_s": after["admission/held_s"],
                "sync_over_limit": round(syncs[best] / limit, 3),
                "sync_best": best,
                "async_over_sync_best": round(asynchronous / syncs[best], 3),
                "rollout_only_samples_per_s": round(rollout, 2),
                "train_only_samples_per_s": round(train, 2),
                "limit_samples_per_s": round(limit, 2),
                "async_samples_per_s": round(asynchronous, 2),
                "async_no_admission_samples_per_s": round(no_admission, 2),
                "sync_disaggregated_samples_per_s": round(synchronous, 2),
                "sync_colocated_samples_per_s": round(sync_colocated, 2),
                "steps": steps,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
