"""Rollout routing replay (R3): the FSDP2 trainer's step time with replay over without, on the
same batch, in one run; and the routing record's bytes per token.

The model is a small random Qwen3-MoE built from a config (``--layers`` layers, ``--experts``
experts of which top-``--top-k``, hidden ``--hidden``), nothing downloaded. The batch is
``--groups`` groups of ``--group-size`` samples (prompt ``--prompt`` tokens, responses
``--response`` tokens) whose routing records draw random expert sets: the trainer's work does
not depend on which experts it routes to, only on how many tokens each takes. Two trainers
start from the same checkpoint, one built with ``routing: replay`` (the router hooks route
every MoE layer by the record and recompute the gate weights), the other without; their GRPO
steps alternate, ``--steps`` each after one unmeasured step, and the median of each is kept.

The last line is JSON: ``r3_overhead`` (median step time with replay over without; goal
<= 1.05), the two medians, and ``bytes_per_token`` (what the record adds to a sample, per
token forwarded; int8 ids while the model has fewer than 128 experts).

    .venv/bin/python benchmarks/routing_replay.py [--steps 5] [--layers 4] [--experts 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import describe

from miles_core.data import Group, RoutedExperts, Sample
from miles_core.testing.tiny_moe import save_tiny_moe


def batch(args: argparse.Namespace, routed: bool) -> list[Group]:
    """The benchmark's groups, with routing records or without (the same tokens)."""
    rng = random.Random(0)
    groups = []
    for _ in range(args.groups):
        prompt = [1] + [rng.randrange(3, args.vocab) for _ in range(args.prompt - 1)]
        samples = []
        for s in range(args.group_size):
            response = [rng.randrange(3, args.vocab) for _ in range(args.response)]
            positions = len(prompt) + len(response) - 1
            record = None
            if routed:
                ids = [
                    e
                    for _ in range(positions * args.layers)
                    for e in rng.sample(range(args.experts), args.top_k)
                ]
                record = RoutedExperts.from_ids(ids, positions)
            sample = Sample(prompt_ids=prompt, reward=float(s % 2))
            sample.append(
                response, logprobs=[-1.0] * len(response), version=0, routed_experts=record
            )
            samples.append(sample)
        groups.append(Group(samples=samples))
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    describe(vars(args))

    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_moe(
            Path(tmp) / "moe",
            "qwen3_moe",
            seed=0,
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            expert_size=args.hidden // 2,
            num_layers=args.layers,
            num_experts=args.experts,
            top_k=args.top_k,
            heads=4,
            kv_heads=2,
        )
        options = FSDP2Options(lr=1e-5, cpu_threads=args.threads)
        trainers: dict[str, Any] = {
            "plain": build(options),
            "replay": build(options, routing="replay"),
        }
        for t in trainers.values():
            t.setup(str(path))
        groups = {"plain": batch(args, False), "replay": batch(args, True)}
        algo = build_policy_gradient(GRPOOptions())
        times: dict[str, list[float]] = {"plain": [], "replay": []}
        metrics: dict[str, float] = {}
        try:
            for step in range(args.steps + 1):
                for name in ("plain", "replay") if step % 2 else ("replay", "plain"):
                    start = time.perf_counter()
                    m = trainers[name].train_step(groups[name], algo)
                    if step:
                        times[name].append(time.perf_counter() - start)
                    if name == "replay":
                        metrics = m
        finally:
            for t in trainers.values():
                t.close()
    plain, replay = statistics.median(times["plain"]), statistics.median(times["replay"])
    print(f"step: {plain:.3f} s without replay, {replay:.3f} s with replay", flush=True)
    print(
        json.dumps(
            {
                "r3_overhead": round(replay / plain, 4),
                "step_s_plain": round(plain, 4),
                "step_s_replay": round(replay, 4),
                "bytes_per_token": round(metrics["routing/bytes_per_token"], 3),
                "expert_agreement": metrics["routing/expert_agreement"],
            }
        )
    )


if __name__ == "__main__":
    main()
