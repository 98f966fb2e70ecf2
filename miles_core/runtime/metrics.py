"""Per-step statistics of the groups a step trained on."""

from __future__ import annotations

import statistics
from typing import Any

from miles_core.data import Group


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and length statistics of the groups a step trained on; in a run that trains
    adapters, each adapter's too (``adapter/<name>/...``)."""
    out = _stats(groups)
    for name in sorted({g.adapter for g in groups if g.adapter is not None}):
        mine = _stats([g for g in groups if g.adapter == name])
        out[f"adapter/{name}/groups"] = float(sum(g.adapter == name for g in groups))
        out[f"adapter/{name}/reward_mean"] = mine["reward/mean"]
        out[f"adapter/{name}/response_length_mean"] = mine["response_length/mean"]
    return out


def _stats(groups: list[Group]) -> dict[str, float]:
    rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
    lengths = [float(sum(s.loss_mask)) for g in groups for s in g.samples]
    counts: dict[str, float] = {}
    for sample in (s for g in groups for s in g.samples):
        for name, value in sample.counts.items():
            counts[f"counts/{name}"] = counts.get(f"counts/{name}", 0.0) + float(value)
    return counts | {
        "reward/mean": _mean(rewards),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length/mean": _mean(lengths),
        "response_length/max": max(lengths, default=0.0),
        "truncated/fraction": _mean(
            [float(s.finish_reason == "length") for g in groups for s in g.samples]
        ),
    }


def heldout_loss(groups: list[Group], logprobs: Any) -> dict[str, float]:
    """The mean negative log-likelihood per trained token of held-out samples, from the
    trainer's log-probs ``[B, T]`` of their response tokens (samples in group order, as
    :meth:`~miles_core.contracts.Trainer.compute_logprobs` returns them)."""
    samples = [s for g in groups for s in g.samples]
    rows = logprobs.tolist()
    total, tokens = 0.0, 0
    for sample, row in zip(samples, rows, strict=True):
        # a row is padded to the batch's longest response
        for trained, logprob in zip(sample.loss_mask, row, strict=False):
            if trained:
                total -= float(logprob)
                tokens += 1
    return {
        "eval/loss": total / max(tokens, 1),
        "eval/loss_tokens": float(tokens),
        "eval/loss_n": float(len(samples)),
    }
