"""Registers the shipped model families with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import ModelFamily, hookimpl
from miles_modelfamilies.options import Qwen3Options


@hookimpl
def miles_register_model_families(register: Callable[[ModelFamily], None]) -> None:
    """The ``smollm2`` and ``qwen3`` families (factories import nothing until built)."""
    register(
        ModelFamily(
            name="smollm2",
            factory="miles_modelfamilies.smollm2:build",
            description="SmolLM2-135M-Instruct: ChatML from its GGUF, JSON-list tool calls",
        )
    )
    register(
        ModelFamily(
            name="qwen3",
            factory="miles_modelfamilies.qwen3:build",
            config=Qwen3Options,
            description="Qwen3: <think> reasoning kept in history, <tool_call> JSON tool calls",
        )
    )
