"""Registers the ``fsdp2`` trainer backend (entry point ``fsdp2`` in the group ``miles``).

Importing this module imports no torch: the factory is a ``"module:attr"`` string.
"""

from __future__ import annotations

from collections.abc import Callable

from miles_trainer_common.record import rank_backend

from miles_backend_fsdp2.options import SUPPORTED_NEEDS, FSDP2Options
from miles_core import TrainerBackend, hookimpl


def backend() -> TrainerBackend:
    """The record of the FSDP2 trainer backend."""
    return rank_backend(
        "fsdp2",
        "miles_backend_fsdp2.trainer:build",
        FSDP2Options,
        "PyTorch FSDP2 (fully_shard) over Hugging Face causal LMs; gloo/CPU, NCCL/GPU",
        SUPPORTED_NEEDS,
        # rollout.routing: the engine's MoE routing record, measured against or replayed
        # (qwen3_moe and mixtral routers)
        routing=True,
    )


@hookimpl
def miles_register_trainer_backends(register: Callable[[TrainerBackend], None]) -> None:
    """Register the ``fsdp2`` trainer backend."""
    register(backend())
