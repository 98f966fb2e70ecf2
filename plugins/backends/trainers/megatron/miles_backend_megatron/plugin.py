"""Registers the ``megatron`` trainer backend (entry point ``megatron`` in the group ``miles``).

Importing this module imports neither torch nor megatron: the factory is a ``"module:attr"``
string.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from miles_trainer_common.record import rank_backend

from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_core import TrainerBackend, hookimpl
from miles_core.errors import ConfigError


def backend() -> TrainerBackend:
    """The record of the Megatron-core trainer backend."""
    return rank_backend(
        "megatron",
        "miles_backend_megatron.trainer:build",
        MegatronOptions,
        "Megatron-core GPTModel (tensor/pipeline/data parallel) from Hugging Face Llama and "
        "Qwen3 checkpoints, with a critic for PPO; gloo/CPU, NCCL/GPU",
        SUPPORTED_NEEDS,
    )


@hookimpl
def miles_register_trainer_backends(register: Callable[[TrainerBackend], None]) -> None:
    """Register the ``megatron`` trainer backend."""
    register(backend())


def check_model(model_path: str, options: MegatronOptions) -> None:
    """Refuse, before any work, a model (or a critic's checkpoint, ``critic.path``) this
    backend cannot build or a split it cannot take: an unknown architecture, a checkpoint whose
    tensors do not match its config, tensor or pipeline parallel sizes that do not divide the
    model. Raises :class:`ConfigError` naming the config field and what is allowed."""
    from miles_backend_megatron.shape import (
        ModelShape,
        ModelShapeError,
        check_checkpoint,
        safetensors_shapes,
    )

    try:
        shape = ModelShape.from_path(model_path)
    except ModelShapeError as exc:
        raise ConfigError([f"model.path: {exc}"]) from None
    try:
        shape.check_parallel(options.tensor_parallel, options.pipeline_parallel)
    except ModelShapeError as exc:
        field = "pipeline_parallel" if "pipeline_parallel" in str(exc) else "tensor_parallel"
        raise ConfigError([f"backend.{field}: {exc}"]) from None
    try:
        check_checkpoint(safetensors_shapes(model_path), shape)
    except ModelShapeError as exc:
        raise ConfigError([f"model.path: {exc}"]) from None
    critic = options.critic.path
    if critic is not None:
        # Built only when the algorithm needs values, but a bad one is refused now.
        try:
            critic_shape = ModelShape.from_path(os.path.expanduser(critic), value=True)
            critic_shape.check_parallel(options.tensor_parallel, options.pipeline_parallel)
            check_checkpoint(safetensors_shapes(critic), critic_shape, value=True)
        except ModelShapeError as exc:
            raise ConfigError([f"backend.critic.path: {exc}"]) from None


@hookimpl
def miles_configure(config: Any) -> None:
    """A run on the ``megatron`` backend: refuse ``distributed_optimizer`` with an adapter, and
    check its model and split (see :func:`check_model`)."""
    if config.backend.name != "megatron":
        return
    options = config.backend.options or MegatronOptions()
    if options.distributed_optimizer and getattr(config, "adapter", None) is not None:
        raise ConfigError(
            [
                "backend.distributed_optimizer: Megatron's distributed optimizer trains the "
                "whole policy; with an adapter (LoRA) use distributed_optimizer: false"
            ]
        )
    path = os.path.expanduser(config.model.path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return  # not a local folder (yet): the trainer's set-up reports it
    check_model(path, options)
