"""What a session's turn is drawn with: a request's sampling fields over the session's
defaults (a rollout sets the run's) over the server's. Each turn records its draw, and a stored
sample the one its turns share (``Sample.sampling_params``: the trainer truncates its log-probs
the same way; :func:`miles_sessions.store.sample_draw`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_sessions import anthropic_api
from miles_sessions.openai_api import ChatRequest
from miles_sessions.options import SessionServerOptions
from miles_sessions.store import SessionError

#: the sampling parameters a turn records and a session may default (SGLang's names)
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def request_sampling(
    req: ChatRequest | anthropic_api.MessagesRequest,
    defaults: Mapping[str, Any],
    options: SessionServerOptions,
    family: Any,
) -> dict[str, Any]:
    """The engine's sampling parameters for ``req``: its own values, else ``defaults`` (the
    session's), else the server's ``options``; stops at the ``family``'s stop tokens. A stop
    string or a ``max_tokens`` over the limit is a 400 naming the field."""
    chat = isinstance(req, ChatRequest)
    stop, field = (req.stop, "stop") if chat else (req.stop_sequences, "stop_sequences")
    if stop:
        raise SessionError(
            400,
            f"{field}: stop strings are not supported: the session stops at the family's "
            f"stop tokens {list(family.stop_token_ids)}",
        )
    if isinstance(req, ChatRequest):
        max_new = req.max_completion_tokens or req.max_tokens or options.max_new_tokens
    else:
        max_new = req.max_tokens
    if max_new > options.max_new_tokens_limit:
        raise SessionError(400, f"max_tokens {max_new} is above {options.max_new_tokens_limit}")
    asked = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    drawn = {"temperature": options.temperature, **defaults}
    drawn.update({k: v for k, v in asked.items() if v is not None})
    if drawn.get("top_k") in (0, None):
        drawn.pop("top_k", None)
    if drawn.get("top_p") is None:
        drawn.pop("top_p", None)
    params: dict[str, Any] = {
        "max_new_tokens": max_new,
        **drawn,
        "stop_token_ids": list(family.stop_token_ids),
    }
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    return params
