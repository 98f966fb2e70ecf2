"""Rollout routing replay (R3): the FSDP2 trainer's step time with replay over without, on the
same batch and the same work, in one run; and the routing record's bytes per token.

The model is a small random Qwen3-MoE built from a config (``--layers`` layers, ``--experts``
experts of which top-``--top-k``, hidden ``--hidden``), nothing downloaded. The batch is
``--groups`` groups of ``--group-size`` samples (prompt ``--prompt`` tokens, responses
``--response`` tokens). The routing record is the model's own: a float32 forward of each
sample at the trainer's starting weights, its routers' top-k taken per layer, as an engine
serving the same weights in float32 would return it. So replay routes every token to the
experts the trainer would pick itself, and the experts do the same work in every trainer:
what differs is replay's own cost (the record's collation and transfer, the router hooks).
(A random record would change the experts' load, and with it the work, so the ratio would
not measure replay.)

Three trainers start from the same checkpoint: ``none`` (no hooks; its samples carry no
record, as in a run without routing), ``record`` (the hooks measure the agreement) and
``replay`` (the hooks route by the record and recompute the gate weights). Their GRPO steps
are interleaved, one round of the three per repeat in a rotating order, ``--steps`` rounds
after one unmeasured round.

The last line is JSON: ``r3_overhead``, the median over rounds of replay's step time over
``none``'s in the same round (goal <= 1.05); ``record_overhead`` likewise; the three median
step times; ``bytes_per_token`` (what the record adds to a sample, per token forwarded; int8
ids while the model has fewer than 128 experts); and ``expert_agreement`` and
``own_agreement`` of the replay trainer (1.0, and the share of the trainer's own top-k equal
to the record: near 1.0, since the record is the model's own routing).

    .venv/bin/python benchmarks/routing_replay.py [--steps 21] [--layers 4] [--experts 8]
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

#: the trainers, by ``rollout.routing``
MODES = ("none", "record", "replay")


def own_routing(path: Path, tokens: list[int]) -> RoutedExperts:
    """The routing of the model at ``path`` on ``tokens`` (prompt + response), as an engine at
    the same weights returns it: every forwarded position's top-k per MoE layer, in float32."""
    from transformers import AutoModelForCausalLM

    model = own_routing.__dict__.get(str(path))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        own_routing.__dict__[str(path)] = model
    chosen: dict[int, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.gate"):
            layer = int(name.split(".layers.")[1].split(".")[0])

            def keep(_m: Any, _a: Any, out: Any, layer: int = layer) -> None:
                chosen[layer] = out[2]

            handles.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
    finally:
        for h in handles:
            h.remove()
    ids = torch.cat([chosen[layer] for layer in sorted(chosen)], dim=-1)  # [positions, L * k]
    return RoutedExperts.from_ids(ids.flatten().tolist(), len(tokens) - 1)


def batch(args: argparse.Namespace, path: Path, routed: bool) -> list[Group]:
    """The benchmark's groups (the same tokens each call), with the model's own routing
    records or without."""
    rng = random.Random(0)
    groups = []
    for _ in range(args.groups):
        prompt = [1] + [rng.randrange(3, args.vocab) for _ in range(args.prompt - 1)]
        samples = []
        for s in range(args.group_size):
            response = [rng.randrange(3, args.vocab) for _ in range(args.response)]
            record = own_routing(path, prompt + response) if routed else None
            sample = Sample(prompt_ids=prompt, reward=float(s % 2))
            sample.append(
                response, logprobs=[-1.0] * len(response), version=0, routed_experts=record
            )
            samples.append(sample)
        groups.append(Group(samples=samples))
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=21)
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
        plain, routed = batch(args, path, False), batch(args, path, True)
        groups = {"none": plain, "record": routed, "replay": routed}
        # an lr far below float32's resolution of the weights: every step runs the same batch
        # at (in effect) the same weights, so the record stays the model's own routing and
        # each step does the same work
        options = FSDP2Options(lr=1e-12, cpu_threads=args.threads)
        trainers: dict[str, Any] = {mode: build(options, routing=mode) for mode in MODES}
        for t in trainers.values():
            t.setup(str(path))
        algo = build_policy_gradient(GRPOOptions())
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        metrics: dict[str, float] = {}
        try:
            for step in range(args.steps + 1):
                order = MODES[step % 3 :] + MODES[: step % 3]
                for mode in order:
                    start = time.perf_counter()
                    m = trainers[mode].train_step(groups[mode], algo)
                    if step:
                        times[mode].append(time.perf_counter() - start)
                    if mode == "replay":
                        metrics = m
        finally:
            for t in trainers.values():
                t.close()
    median = {mode: statistics.median(times[mode]) for mode in MODES}

    def overhead(mode: str) -> float:
        return statistics.median(a / b for a, b in zip(times[mode], times["none"], strict=True))

    print(
        f"step: {median['none']:.3f} s without routing, {median['record']:.3f} s recording, "
        f"{median['replay']:.3f} s replaying",
        flush=True,
    )
    print(
        json.dumps(
            {
                "r3_overhead": round(overhead("replay"), 4),
                "record_overhead": round(overhead("record"), 4),
                "step_s_none": round(median["none"], 4),
                "step_s_record": round(median["record"], 4),
                "step_s_replay": round(median["replay"], 4),
                "bytes_per_token": round(metrics["routing/bytes_per_token"], 3),
                "expert_agreement": metrics["routing/expert_agreement"],
                "own_agreement": metrics["routing/own_agreement"],
            }
        )
    )


if __name__ == "__main__":
    main()
