"""Anthropic's Messages API on a session: requests translated to the session's messages, stored
turns answered as Anthropic messages (whole, or as Anthropic's SSE events).

A Messages request maps onto the same session, the same stored turns and the same tokens as a
chat-completions request: ``system`` becomes the first (system) message; a user message's text
blocks one user message and each ``tool_result`` block one tool message (``tool_use_id`` its
``tool_call_id``); an assistant message's ``thinking`` blocks its ``reasoning_content``, text
blocks its content and ``tool_use`` blocks its tool calls (``input`` as JSON arguments); a
tool's ``input_schema`` its function's ``parameters``. A stored reply is answered as thinking,
text and ``tool_use`` blocks, a tool call keeping its id (``call_{turn}_{i}``), so a
conversation may go back and forth between both APIs.

Bad input is a :class:`~miles_sessions.store.SessionError` (400) naming the field as
``messages[1].content[0].type``. Unknown fields are ignored, as on the OpenAI route.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from miles_sessions.openai_api import extension
from miles_sessions.store import Session, SessionError, Turn

Message = dict[str, Any]

#: The key of a ``tool_use`` block's ``input`` that holds the generated arguments when they are
#: not a JSON object (a malformed call): ``input`` must be an object, and the raw text is kept.
RAW_ARGUMENTS = "_raw_arguments"

#: Anthropic's error type per HTTP status (others: ``invalid_request_error``, 5xx ``api_error``).
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error as Anthropic's clients read it (``{"type": "error", "error": {...}}``)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": status}}


class MessagesRequest(BaseModel):
    """``POST .../v1/messages``; ``messages``, ``system`` and ``tools`` are checked block by
    block by :func:`to_session` (its errors name the exact field). ``seed`` is an extension
    (the engine's sampling seed, as on the OpenAI route)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Any] = Field(min_length=1)
    system: StrictStr | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    stop_sequences: list[StrictStr] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _bad(where: str, message: str) -> SessionError:
    return SessionError(400, f"{where}: {message}")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, not {type(value).__name__}")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """``content`` as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of blocks, not {type(content).__name__}")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad(f"{where}[{j}]", f"must be an object, not {type(block).__name__}")
        _str(block.get("type"), f"{where}[{j}].type")
    return content


def _text_only(content: Any, where: str) -> str:
    """The text of a system prompt or a tool result (text blocks only)."""
    if content is None:
        return ""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise _bad(f"{where}[{j}].type", f"{block['type']!r} is not supported here (text)")
        parts.append(_str(block.get("text"), f"{where}[{j}].text"))
    return "".join(parts)


def _user(content: Any, where: str) -> list[Message]:
    """A user message's blocks: runs of text blocks as user messages, each ``tool_result`` as a
    tool message, in their order."""
    out: list[Message] = []
    text: list[str] | None = None
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        if block["type"] == "text":
            if text is None:
                text = []
                out.append({"role": "user", "content": ""})
            text.append(_str(block.get("text"), f"{at}.text"))
            out[-1]["content"] = "".join(text)
        elif block["type"] == "tool_result":
            text = None
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(block.get("tool_use_id"), f"{at}.tool_use_id"),
                    "content": _text_only(block.get("content"), f"{at}.content"),
                }
            )
        else:
            raise _bad(
                f"{at}.type",
                f"{block['type']!r} is not supported in a user message (text, tool_result)",
            )
    if not out:
        raise _bad(f"{where}.content", "must hold a text or tool_result block")
    return out


def _arguments(block: dict[str, Any], where: str) -> str:
    value = block.get("input")
    if not isinstance(value, dict):
        raise _bad(f"{where}.input", f"must be an object, not {type(value).__name__}")
    raw = value.get(RAW_ARGUMENTS)
    if len(value) == 1 and isinstance(raw, str):
        return raw  # a malformed call sent back: its generated text
    return json.dumps(value, ensure_ascii=False)


def _assistant(content: Any, where: str) -> Message:
    """An assistant message's thinking, text and ``tool_use`` blocks as one message."""
    text, thinking, calls = [], [], []
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            text.append(_str(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thinking.append(_str(block.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": _str(block.get("id"), f"{at}.id"),
                    "type": "function",
                    "function": {
                        "name": _str(block.get("name"), f"{at}.name"),
                        "arguments": _arguments(block, at),
                    },
                }
            )
        else:
            raise _bad(
                f"{at}.type",
                f"{kind!r} is not supported in an assistant message (text, thinking, tool_use)",
            )
    msg: Message = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools as the session's (OpenAI-format) tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"must be an object, not {type(tool).__name__}")
        if tool.get("type", "custom") != "custom":
            raise _bad(
                f"{where}.type",
                f"{tool['type']!r} is not supported: only client tools (type 'custom' or none) "
                "with a name and an input_schema",
            )
        name = _str(tool.get("name"), f"{where}.name")
        if not name:
            raise _bad(f"{where}.name", "must not be empty")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema", "must be a JSON-schema object")
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = _str(tool["description"], f"{where}.description")
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def to_session(req: MessagesRequest) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The request's messages and tools in the session's form (see the module docstring)."""
    choice = (req.tool_choice or {}).get("type", "auto")
    if choice not in ("auto", "none"):
        raise _bad("tool_choice.type", f"{choice!r} is not supported (auto, none)")
    messages: list[Message] = []
    system = _text_only(req.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"must be an object, not {type(m).__name__}")
        role = m.get("role")
        if role == "user":
            messages.extend(_user(m.get("content"), where))
        elif role == "assistant":
            messages.append(_assistant(m.get("content"), where))
        else:
            raise _bad(
                f"{where}.role", f"{role!r} is not 'user' or 'assistant' (a system prompt: system)"
            )
    if req.messages[-1].get("role") != "user":
        raise _bad(
            f"messages[{len(req.messages) - 1}].role",
            "the last message must be 'user' (a prefilled assistant reply is not supported)",
        )
    return messages, _tools(req.tools)


# --- answers ------------------------------------------------------------------------------------


def stop_reason(turn: Turn) -> str:
    """Anthropic's stop reason of a stored turn."""
    if turn.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if turn.reply and turn.reply.get("tool_calls") else "end_turn"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {RAW_ARGUMENTS: arguments}


def content_blocks(turn: Turn) -> list[dict[str, Any]]:
    """The stored reply as thinking, text and ``tool_use`` blocks."""
    reply = turn.reply or {}
    blocks: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
    if reply.get("content"):
        blocks.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _input(function["arguments"]),
            }
        )
    return blocks


def message(session: Session, turn: Turn, *, model: str, prompt_tokens: int) -> dict[str, Any]:
    """The non-streamed answer: an Anthropic message, with the ``miles`` extension."""
    return {
        "id": f"msg_{session.id}_{turn.index}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(turn),
        "stop_reason": stop_reason(turn),
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": len(turn.gen_ids)},
        "miles": extension(session, turn),
    }


def _block_events(index: int, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind = block["type"]
    start: dict[str, Any]
    if kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
    elif kind == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        partial = json.dumps(block["input"], ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
    yield {"type": "content_block_start", "index": index, "content_block": start}
    yield {"type": "content_block_delta", "index": index, "delta": delta}
    yield {"type": "content_block_stop", "index": index}


def events(session: Session, turn: Turn, *, model: str, prompt_tokens: int) -> list[dict[str, Any]]:
    """The streamed answer as Anthropic's SSE events (the engine answers whole turns, so each
    block comes as one start, one delta and one stop)."""
    whole = message(session, turn, model=model, prompt_tokens=prompt_tokens)
    start = {**whole, "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": prompt_tokens, "output_tokens": 0}
    out = [{"type": "message_start", "message": start}]
    for i, block in enumerate(whole["content"]):
        out.extend(_block_events(i, block))
    out.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": len(turn.gen_ids)},
        }
    )
    out.append({"type": "message_stop"})
    return out
