"""Parsers that split generated assistant text into content, reasoning and tool calls.

Each parser mirrors how its family's template renders the same fields, so that parsing the
render of an assistant message gives the message back (tests check the round trip).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS_VERSION = "2"


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


@dataclass(frozen=True)
class XmlFunctionToolParser:
    """Tool calls as Qwen3.5 (and Qwen3-Coder) write them::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    The template writes a string value as is and any other value as JSON, so a value is read
    back as JSON when it parses as a number, boolean, null, object or array, and as the string
    otherwise. (A string argument that itself looks like JSON, ``"1"``, comes back as ``1``: the
    format cannot tell them apart without the tool's schema.) Content is the text before the
    first block, without the separating blank line. A block that does not parse stays in the
    content and is reported under ``tool_call_errors``.
    """

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    name: str = "xml_function"

    _FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>\n(.*?)</function>\s*$", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n?", re.DOTALL)

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
                call = self._call(match.group(1))
            except ValueError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                kept.append(match.group(0))
                continue
            call["id"] = f"call_{len(calls)}"
            calls.append(call)
        kept.append(text[cursor:])
        content = "".join(kept)
        if calls:
            content = content.strip("\n")
        return content, calls, errors

    def _call(self, body: str) -> dict[str, Any]:
        found = self._FUNCTION.match(body)
        if found is None:
            raise ValueError(f"no <function=...> block in {body[:60]!r}")
        name, inner = found.group(1), found.group(2)
        arguments: dict[str, Any] = {}
        cursor = 0
        for param in self._PARAM.finditer(inner):
            if inner[cursor : param.start()].strip():
                raise ValueError(
                    f"unexpected text in a tool call: {inner[cursor : param.start()]!r}"
                )
            arguments[param.group(1)] = _xml_value(param.group(2))
            cursor = param.end()
        if inner[cursor:].strip():
            raise ValueError(f"unexpected text in a tool call: {inner[cursor:]!r}")
        return {
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }


def _xml_value(raw: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    # Only values the template would have written as JSON; a bare string stays a string.
    return raw if isinstance(value, str) else value


@dataclass(frozen=True)
class ExactThinkReasoningParser:
    """``reasoning</think>content`` split at the first ``</think>`` with nothing stripped, as
    DeepSeek V4 writes it (its generation prompt already opened ``<think>``). Text without
    ``</think>`` (a generation cut short) is all reasoning."""

    end: str = "</think>"
    name: str = "think_exact"

    def split(self, text: str) -> tuple[str | None, str]:
        """Return ``(reasoning, remaining text)``."""
        if self.end in text:
            before, after = text.split(self.end, 1)
            return before, after
        return text, ""


@dataclass(frozen=True)
class DsmlToolParser:
    """DeepSeek V4's DSML tool calls, after the content and a blank line::

        \\n\\n<｜DSML｜tool_calls>
        <｜DSML｜invoke name="NAME">
        <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    ``string="true"`` values are text, the others JSON. A block that does not parse stays in
    the content and is reported under ``tool_call_errors``.
    """

    dsml: str = "｜DSML｜"
    name: str = "dsml"

    def split(self, text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
        """Return ``(content, tool_calls, errors)``; tool calls in the OpenAI format."""
        opening = f"\n\n<{self.dsml}tool_calls>\n"
        closing = f"</{self.dsml}tool_calls>"
        at = text.find(opening)
        if at < 0 or not text.endswith(closing):
            return text, [], []
        body = text[at + len(opening) : -len(closing)]
        try:
            calls = self._calls(body)
        except (ValueError, TypeError) as exc:
            return text, [], [f"{type(exc).__name__}: {exc}"]
        return text[:at], calls, []

    def _calls(self, body: str) -> list[dict[str, Any]]:
        d = re.escape(self.dsml)
        invoke = re.compile(rf'<{d}invoke name="([^"]*)">\n(.*?)\n?</{d}invoke>\n', re.DOTALL)
        param = re.compile(
            rf'<{d}parameter name="([^"]*)" string="(true|false)">(.*?)</{d}parameter>(?:\n|$)',
            re.DOTALL,
        )
        calls: list[dict[str, Any]] = []
        cursor = 0
        for found in invoke.finditer(body):
            if found.start() != cursor:
                raise ValueError(f"unexpected text in tool calls: {body[cursor : found.start()]!r}")
            cursor = found.end()
            arguments: dict[str, Any] = {}
            inner, pos = found.group(2), 0
            for p in param.finditer(inner):
                if p.start() != pos:
                    raise ValueError(f"unexpected text in a tool call: {inner[pos : p.start()]!r}")
                pos = p.end()
                key, is_str, value = p.groups()
                arguments[key] = value if is_str == "true" else json.loads(value)
            if inner[pos:].strip():
                raise ValueError(f"unexpected text in a tool call: {inner[pos:]!r}")
            calls.append(
                {
                    "id": f"call_{len(calls)}",
                    "type": "function",
                    "function": {
                        "name": found.group(1),
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
        if cursor != len(body) or not calls:
            raise ValueError(f"unexpected text in tool calls: {body[cursor:]!r}")
        return calls
