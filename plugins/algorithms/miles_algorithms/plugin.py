"""Registers the algorithms with Miles (entry point ``algorithms`` in the group ``miles``).

Importing this module imports no torch: factories are ``"module:attr"`` strings, loaded only
when a run builds its algorithm.
"""

from __future__ import annotations

from collections.abc import Callable

from miles_algorithms.checks import async_needs_off_policy_choice
from miles_algorithms.options import (
    DistillationOptions,
    DrGRPOOptions,
    GRPOOptions,
    GSPOOptions,
    PPOOptions,
    ReinforcePPBaselineOptions,
    ReinforcePPOptions,
    SFTOptions,
)
from miles_core import Algorithm, hookimpl

_PG = "miles_algorithms.algorithms:build_policy_gradient"

# `needs` is static on the record, so it lists every input that some valid options use: the
# reference log-probs (KL), the recomputed behaviour log-probs and, for PPO, the critic's
# values. The built object's `needs` property says exactly what its options use.
_RATIO_NEEDS = frozenset({"old_logprobs", "ref_logprobs"})


def _ratio_algorithm(
    name: str, config: type, description: str, needs: frozenset[str] = _RATIO_NEEDS
) -> Algorithm:
    return Algorithm(
        name=name,
        factory=_PG,
        config=config,
        description=description,
        needs=needs,
        importance_ratios=True,
        check=async_needs_off_policy_choice,
    )


def algorithms() -> list[Algorithm]:
    """Every algorithm record this plugin registers."""
    return [
        _ratio_algorithm(
            "grpo", GRPOOptions, "GRPO: group-normalised advantages, clipped token ratio"
        ),
        _ratio_algorithm(
            "dr_grpo", DrGRPOOptions, "Dr. GRPO: group-mean baseline, constant-length normaliser"
        ),
        _ratio_algorithm(
            "gspo", GSPOOptions, "GSPO: sequence-level ratio (geometric mean), sequence clipping"
        ),
        _ratio_algorithm(
            "ppo",
            PPOOptions,
            "PPO: critic values, GAE, clipped value loss",
            needs=_RATIO_NEEDS | {"values"},
        ),
        _ratio_algorithm(
            "reinforce_pp",
            ReinforcePPOptions,
            "REINFORCE++: KL-shaped discounted returns, global normalisation",
        ),
        _ratio_algorithm(
            "reinforce_pp_baseline",
            ReinforcePPBaselineOptions,
            "REINFORCE++ with a group-mean baseline",
        ),
        Algorithm(
            name="on_policy_distillation",
            factory="miles_algorithms.algorithms:build_distillation",
            config=DistillationOptions,
            description="On-policy distillation: per-token reverse KL to a teacher",
            # the teacher's log-probs come with the samples, scored by the teacher's engine
            # (the run config's teacher section); stale samples are importance-weighted
            needs=frozenset({"teacher_logprobs"}),
        ),
        Algorithm(
            name="sft",
            factory="miles_algorithms.algorithms:build_sft",
            config=SFTOptions,
            description="SFT: negative log-likelihood of the loss-masked tokens",
            # Conversations from data, rendered by the model family, unless the config names
            # another rollout function (for example single_turn with a filter, to train on
            # the policy's own best samples).
            default_rollout_function="sft",
        ),
    ]


@hookimpl
def miles_register_algorithms(register: Callable[[Algorithm], None]) -> None:
    """Register GRPO, Dr. GRPO, GSPO, PPO, REINFORCE++ (+ baseline), distillation and SFT."""
    for record in algorithms():
        register(record)
