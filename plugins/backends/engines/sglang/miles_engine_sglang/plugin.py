"""Registers the ``sglang`` rollout engine with Miles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_core import RolloutEngine, hookimpl
from miles_engine_sglang.options import SGLangEngineConfig

if TYPE_CHECKING:
    from miles_core.config import RunConfig


def check(config: RunConfig) -> str | None:
    """Refuse a colocated run whose engines cannot give their GPU memory back, and a run that
    trains an adapter on engines started without LoRA, or records the MoE routing on engines
    started without returning it."""
    options = getattr(config.engine, "options", None)
    if (
        config.rollout.routing != "none"
        and isinstance(options, SGLangEngineConfig)
        and not options.enable_return_routed_experts
    ):
        return (
            f"rollout.routing {config.rollout.routing!r}: the engines return the routed "
            "experts only when started with engine option enable_return_routed_experts: true"
        )
    if (
        config.adapter is not None
        and isinstance(options, SGLangEngineConfig)
        and not options.enable_lora
    ):
        return (
            f"adapter {config.adapter.name!r}: the engines serve the trained adapter, which "
            "needs engine option enable_lora: true (with max_lora_rank at least the adapter's "
            "rank and lora_target_modules covering its targets)"
        )
    if (
        config.run.placement == "colocated"
        and isinstance(options, SGLangEngineConfig)
        and not options.enable_memory_saver
    ):
        return (
            "colocated placement needs engine option enable_memory_saver: true, so the "
            "engines can release GPU memory while the trainer trains"
        )
    return None


@hookimpl
def miles_register_rollout_engines(register):  # type: ignore[no-untyped-def]
    """Register the SGLang engine."""
    register(
        RolloutEngine(
            name="sglang",
            factory="miles_engine_sglang.launcher:build",
            config=SGLangEngineConfig,
            description="SGLang servers (python -m sglang.launch_server), one per engine, on "
            "GPUs; SGLang is installed separately on the GPU machines",
            devices=("cuda",),
            # SGLang's own endpoints; not p2p_weights: SGLang has no NIXL receiver endpoint
            capabilities=frozenset(
                {
                    "input_logprobs",
                    "lora",
                    "routed_experts",
                    "update_weights_from_tensor",
                    "update_weights_from_distributed",
                    "memory_occupation",
                }
            ),
            check=check,
            requires={"modality": ("text",)},  # token ids in, token ids out
        )
    )
