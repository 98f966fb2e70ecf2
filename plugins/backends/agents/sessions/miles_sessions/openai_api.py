"""OpenAI chat-completions bodies: strict request models and the answers (whole or SSE chunks).

Requests accept the fields the official clients send; the ones a session cannot honour are
refused with a 400 naming them rather than silently ignored (``n > 1``, string ``stop``).
Unknown fields are ignored (clients add vendor fields freely).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from miles_sessions.store import Session, Turn

_LENIENT = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    """A text part of a message's content (the only part type a text family renders)."""

    model_config = _LENIENT
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    """The function of a tool call."""

    model_config = _LENIENT
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """A tool call in an assistant message sent back by the client."""

    model_config = _LENIENT
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a request."""

    model_config = _LENIENT
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    def canonical(self) -> dict[str, Any]:
        """The message as the session stores and renders it."""
        if isinstance(self.content, list):
            content = "".join(p.text for p in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id or f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments
                        if isinstance(c.function.arguments, str)
                        else json.dumps(c.function.arguments, ensure_ascii=False),
                    },
                }
                for i, c in enumerate(self.tool_calls)
            ]
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class FunctionSpec(BaseModel):
    """A tool's function schema."""

    model_config = ConfigDict(extra="allow")
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """A tool offered to the model."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(BaseModel):
    """``POST .../v1/chat/completions``."""

    model_config = _LENIENT
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(1, ge=1, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictBool | None = None


def finish_reason(turn: Turn) -> str:
    """OpenAI finish reason of a stored turn."""
    if turn.finish_reason == "stop" and turn.reply and turn.reply.get("tool_calls"):
        return "tool_calls"
    return "length" if turn.finish_reason == "length" else "stop"


def _message(turn: Turn) -> dict[str, Any]:
    reply = turn.reply or {}
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or None}
    if "reasoning_content" in reply:
        msg["reasoning_content"] = reply["reasoning_content"]
    if reply.get("tool_calls"):
        msg["tool_calls"] = reply["tool_calls"]
    return msg


def extension(session: Session, turn: Turn) -> dict[str, Any]:
    """The ``miles`` object of an answer: the session, the turn, its stored ids and its
    malformed tool calls (see :mod:`miles_sessions.toolcalls`)."""
    return {
        "session_id": session.id,
        "turn": turn.index,
        "weight_version": turn.weight_version,
        "canonical": turn.canonical,
        "completion_ids": turn.gen_ids,
        "tool_call_errors": turn.tool_call_errors,
    }


def _logprobs(session: Session, turn: Turn) -> dict[str, Any]:
    return {
        "content": [
            {"token": session.family.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(turn.gen_ids, turn.logprobs, strict=True)
        ]
    }


def completion(
    session: Session, turn: Turn, *, model: str, prompt_tokens: int, logprobs: bool
) -> dict[str, Any]:
    """The non-streamed answer."""
    return {
        "id": f"chatcmpl-{session.id}-{turn.index}",
        "object": "chat.completion",
        "created": int(turn.created),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(turn),
                "finish_reason": finish_reason(turn),
                "logprobs": _logprobs(session, turn) if logprobs else None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(turn.gen_ids),
            "total_tokens": prompt_tokens + len(turn.gen_ids),
        },
        "miles": extension(session, turn),
    }


def chunks(
    session: Session, turn: Turn, *, model: str, prompt_tokens: int, usage: bool
) -> list[dict[str, Any]]:
    """The streamed answer as chat.completion.chunk objects (the engine answers whole turns,
    so the reply is sent as a role chunk, reasoning, content, tool calls and a final chunk)."""
    base = {
        "id": f"chatcmpl-{session.id}-{turn.index}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

    msg = _message(turn)
    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("reasoning_content"):
        out.append(chunk({"reasoning_content": msg["reasoning_content"]}))
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}))
    for i, call in enumerate(msg.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, finish_reason(turn)))
    if usage:
        n = len(turn.gen_ids)
        out.append(
            {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                },
            }
        )
    return out
