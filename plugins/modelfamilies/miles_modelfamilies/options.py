"""Options models of the families, importable without building anything (the plugin module
imports them when Miles lists plugins or validates a config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Qwen3Options(BaseModel):
    """Options of the ``qwen3`` family."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool = Field(
        True,
        description="template argument: with false the generation prompt closes an empty "
        "<think></think> block, so the model answers without reasoning",
    )
    template: Literal["keep-reasoning", "original"] = Field(
        "keep-reasoning",
        description="keep-reasoning (append-only, passes the CPU gate) or original (drops "
        "earlier reasoning; fails the CPU gate)",
    )


class Qwen3_5Options(BaseModel):
    """Options of the ``qwen3_5`` family."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool = Field(
        True,
        description="template argument: with false the generation prompt closes an empty "
        "<think></think> block",
    )
    clear_thinking: bool = Field(
        False,
        description="template argument: true drops the reasoning of turns before the last "
        "user query (the original behaviour; not append-only, fails the CPU gate)",
    )


class Qwen3Thinking2507Options(BaseModel):
    """Options of the ``qwen3_thinking_2507`` family."""

    model_config = ConfigDict(extra="forbid")

    clear_thinking: bool = Field(
        False,
        description="template argument: true drops earlier reasoning (the original "
        "behaviour; not append-only, fails the CPU gate)",
    )


class DeepSeekV4Options(BaseModel):
    """Options of the ``deepseek_v4`` family."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool = Field(
        True, description="thinking mode: the generation prompt opens <think> (else </think>)"
    )
    drop_thinking: bool = Field(
        False,
        description="the encoder's default: drop the reasoning of turns before the last user "
        "message (not append-only; fails the CPU gate)",
    )
