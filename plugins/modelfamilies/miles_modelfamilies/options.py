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
