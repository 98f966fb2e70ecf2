"""Parsers that split generated assistant text into content, reasoning and tool calls.

Each parser mirrors how its family's template renders the same fields, so that parsing the
render of an assistant message gives the message back (tests check the round trip).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS_VERSION = "1"


@dataclass(frozen=True)
class ThinkReasoningParser:
    """``<think>reasoning</think>content``, as Qwen3 writes it.

    The split is the template's own: reasoning is what precedes ``</think>`` (after any
    ``<think>``), stripped of newlines; content is what follows, without leading newlines.
    Text with ``<think>`` but no ``</think>`` (a generation cut short) is all reasoning.
    """

    start: str = "<think>"
    end: str = "</think>"
    name: str = "think"

    def split(self, text: str) -> tuple[str | None, str]:
        """Return ``(reasoning or None, remaining text)``."""
        if self.end in text:
            before, after = text.split(self.end, 1)
            return before.rstrip("\n").split(self.start)[-1].lstrip("\n"), after.lstrip("\n")
        if text.lstrip().startswith(self.start):
            return text.lstrip()[len(self.start) :].strip("\n"), ""
        return None, text


@dataclass(frozen=True)
class TaggedJsonToolParser:
    """Tool calls as JSON inside ``<tool_call>...</tool_call>`` blocks.

    A block holds one object ``{"name": ..., "arguments": {...}}`` (Qwen3, Hermes) or a list of
    them (SmolLM2). Content is the text before the first block, without the separator newline
    the template adds. A block whose JSON does not parse is left in the content (the caller sees
    what the model wrote) and reported under ``tool_call_errors``.
    """

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    name: str = "tagged_json"

    def split(self, text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
        """Return ``(content, tool_calls, errors)``; tool calls in the OpenAI format."""
        pattern = re.compile(re.escape(self.start) + r"(.*?)" + re.escape(self.end), re.DOTALL)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        kept: list[str] = []
        cursor = 0
        for match in pattern.finditer(text):
            kept.append(text[cursor : match.start()])
            cursor = match.end()
            try:
                payload = json.loads(match.group(1).strip())
                items = payload if isinstance(payload, list) else [payload]
                parsed = [self._call(item) for item in items]
            except (ValueError, TypeError, KeyError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                kept.append(match.group(0))
                continue
            for call in parsed:
                call["id"] = f"call_{len(calls)}"
                calls.append(call)
        kept.append(text[cursor:])
        content = "".join(kept)
        if calls:
            content = content.strip("\n")
        return content, calls, errors

    @staticmethod
    def _call(item: Any) -> dict[str, Any]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise TypeError("a tool call must be an object with a string 'name'")
        arguments = item.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {"type": "function", "function": {"name": item["name"], "arguments": arguments}}
