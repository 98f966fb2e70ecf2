"""Registers the ``fsdp2`` trainer backend (entry point ``fsdp2`` in the group ``miles``).

Importing this module imports no torch: the factory is a ``"module:attr"`` string.
"""

from __future__ import annotations

from collections.abc import Callable

from miles_backend_fsdp2.options import SUPPORTED_NEEDS, FSDP2Options
from miles_core import TrainerBackend, hookimpl


def backend() -> TrainerBackend:
    """The record of the FSDP2 trainer backend."""
    return TrainerBackend(
        name="fsdp2",
        factory="miles_backend_fsdp2.trainer:build",
        config=FSDP2Options,
        description="PyTorch FSDP2 (fully_shard) over Hugging Face causal LMs; gloo/CPU, NCCL/GPU",
        devices=("cpu", "cuda"),
        # Checked against the algorithm's needs when a run is validated: PPO's values (the
        # critic) included; a distillation teacher's log-probs come with the samples.
        computes=SUPPORTED_NEEDS,
        # Causal LMs: a text run (a diffusion folder is refused at start)
        requires={"modality": ("text",)},
        # A run's adapter (miles-lora) wraps the policy; only the adapter trains and syncs.
        adapters=frozenset({"lora"}),
        # Several adapters on one base (the config's adapters): each group trains its own.
        multi_adapter=True,
        # rollout.routing: the engine's MoE routing record, measured against or replayed
        # (qwen3_moe and mixtral routers)
        routing=True,
        # rollout.true_on_policy: the batch-invariant kernels of miles_core.invariant (dense,
        # float32, SDPA)
        true_on_policy=True,
    )


@hookimpl
def miles_register_trainer_backends(register: Callable[[TrainerBackend], None]) -> None:
    """Register the ``fsdp2`` trainer backend."""
    register(backend())
