"""Options of the session server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SessionServerOptions(BaseModel):
    """How the session server listens, generates and renders."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = Field(
        None,
        description="listen address (default: this node's, MILES_NODE_ADDRESS, else "
        "127.0.0.1); beyond loopback needs token or MILES_API_KEY",
    )
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    token: str | None = Field(
        None, min_length=16, description="bearer token clients send (default: MILES_API_KEY)"
    )
    default_mode: Literal["linear", "branching"] = "linear"
    max_new_tokens: int = Field(512, ge=1, description="when a request gives no max_tokens")
    max_new_tokens_limit: int = Field(32768, ge=1, description="largest max_tokens accepted")
    temperature: float = Field(1.0, ge=0.0, description="when a request gives none")
    window: Literal["turn", "full"] = Field(
        "turn", description="render the header and last turn on (turn) or all history (full)"
    )
    verify_window: bool = Field(False, description="also render all history and compare")
    max_sessions: int = Field(100_000, ge=1)
    max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="larger bodies are a 413, refused from Content-Length"
    )
    max_text_chars: int = Field(
        4 * 2**20,
        ge=1,
        description=(
            "most characters of message and tool text one request may bring (a 413 before "
            "anything is tokenized); the default is a 131072-token context at 32 characters "
            "a token, more than any tokenizer packs"
        ),
    )
    engine_timeout_s: float = Field(600.0, gt=0)
    model_name: str = Field("miles", description="the `model` reported in answers")
    family_options: dict[str, Any] = Field(default_factory=dict)
