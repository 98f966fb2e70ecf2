"""Options models of the families, importable without building anything (the plugin module
imports them when Miles lists plugins or validates a config)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


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


class EngineGateOptions(BaseModel):
    """Options of the engine gate (``verify_family(..., engine_options={...})``).

    The gate drives a server speaking SGLang's native HTTP API: the one at ``url``, or one it
    starts through the plugin registry (``engine``, by default the installed rollout engine
    whose record says it runs on CPU) on ``model``.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    url: str | None = Field(
        None,
        validation_alias=AliasChoices("url", "engine_url"),
        description="base URL of a running engine serving the family's model "
        "(http://HOST:PORT); nothing is started",
    )
    engine: str | None = Field(
        None,
        description="rollout engine to start (a registered name); default: the one installed "
        "engine that runs on CPU",
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="options of the started engine (its own options model)"
    )
    model: str | None = Field(
        None,
        description="Hugging Face folder the started engine serves; default: the converted "
        "SmolLM2-135M-Instruct for smollm2, a scripted tiny model otherwise",
    )
    scripted: bool = Field(
        False,
        description="the engine at url serves the family's scripted tiny model (its replies "
        "must then end with a stop token and call the tool where the format allows)",
    )
    max_tokens: int | None = Field(
        None, ge=1, description="tokens per reply (default 64 scripted, 48 otherwise)"
    )
    timeout_s: float = Field(600.0, gt=0, description="limit of one /generate request")

    @model_validator(mode="after")
    def _one_engine(self) -> EngineGateOptions:
        if self.url is not None and (self.engine is not None or self.engine_options):
            raise ValueError("give url (a running engine) or engine/engine_options, not both")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https:// (got {self.url!r})")
        if self.url is not None and self.model is not None:
            raise ValueError("model names what a started engine serves; with url, omit it")
        return self
