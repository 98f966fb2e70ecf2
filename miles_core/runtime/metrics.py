"""Per-step statistics of the groups a step trained on."""

from __future__ import annotations

import statistics

from miles_core.data import Group


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and length statistics of the groups a step trained on."""
    rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
    lengths = [float(sum(s.loss_mask)) for g in groups for s in g.samples]
    return {
        "reward/mean": _mean(rewards),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length/mean": _mean(lengths),
        "response_length/max": max(lengths, default=0.0),
        "truncated/fraction": _mean(
            [float(s.finish_reason == "length") for g in groups for s in g.samples]
        ),
    }
