"""A generation request and its progress through the engine, and the engine's refusal."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_engine_embedded.protocol import SamplingParams
from miles_engine_embedded.sampling import UniformStream


@dataclass
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    on_done: Callable[[Request], None]
    uniforms: UniformStream
    max_new_tokens: int = 0
    #: with ``return_logprob``: first input position whose log-prob is returned (-1: none)
    logprob_start_len: int = -1
    #: log-prob of each input token from ``logprob_start_len`` on (None at position 0)
    input_logprobs: list[float | None] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    #: the LoRA adapter it is served with (None: the base model)
    lora: str | None = None
    #: record the experts its tokens are routed to (SGLang's ``return_routed_experts``)
    return_routed_experts: bool = False
    #: with ``return_routed_experts``: the top-k expert ids ``[positions, moe_layers, k]`` of
    #: every forwarded position, in chunks (the prefill's, then one per decode step)
    routed: list[torch.Tensor] = field(default_factory=list)
    #: while running: (the adapter and its installation, whether it records its routing, the
    #: sequence) its prefill forwarded,
    #: the logits that ended it and the weights' version then (a request with the same key
    #: copies them instead: never across adapters)
    prefill_key: tuple[tuple[str | None, int, bool], tuple[int, ...]] | None = None
    prefill_logits: Any = None
    prefill_version: str = ""
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether the request asked for log-probs of its input tokens."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def reserved(self) -> int:
        """Tokens this request may occupy in the cache at most."""
        return len(self.input_ids) + self.max_new_tokens


class EngineError(Exception):
    """A control command was refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
