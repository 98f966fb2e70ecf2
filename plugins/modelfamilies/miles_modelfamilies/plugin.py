"""Registers the shipped model families with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import ModelFamily, hookimpl
from miles_modelfamilies.options import (
    DeepSeekV4Options,
    Qwen3_5Options,
    Qwen3Options,
    Qwen3Thinking2507Options,
)


@hookimpl
def miles_register_model_families(register: Callable[[ModelFamily], None]) -> None:
    """The shipped families (factories import nothing until built)."""
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
    register(
        ModelFamily(
            name="qwen3_5",
            factory="miles_modelfamilies.qwen3_5:build",
            config=Qwen3_5Options,
            description="Qwen3.5/3.6: <think> reasoning kept in history, XML tool calls",
        )
    )
    register(
        ModelFamily(
            name="qwen3_thinking_2507",
            factory="miles_modelfamilies.qwen3_5:build_thinking_2507",
            config=Qwen3Thinking2507Options,
            description="Qwen3-2507 thinking: <think> always open, <tool_call> JSON",
        )
    )
    register(
        ModelFamily(
            name="deepseek_v4",
            factory="miles_modelfamilies.deepseek_v4:build",
            config=DeepSeekV4Options,
            description="DeepSeek V4: reasoning kept in history, DSML tool calls",
        )
    )
