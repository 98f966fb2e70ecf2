"""The ``conversations`` data source: chat conversations for supervised fine-tuning, one per
row of a JSON Lines or Parquet file, each with a ``messages`` list (OpenAI chat format:
``role``, ``content``, and ``tool_calls`` / ``reasoning_content`` on assistant turns) and,
optionally, the ``tools`` it may call (a list of schemas, or its JSON text). Every row is read
into memory when the source is built.

Every row is checked when the source is built. A row without any assistant turn has nothing to
train on: it is skipped and counted (``data/skipped_rows`` at every step, ``skipped_rows`` in
the final summary, and a warning naming the first one), or refused with ``on_no_assistant:
error``. A malformed row is always refused, naming the row and the field: unlike a prompt set,
whose broken rows cost a few prompts, a conversation set with malformed turns is a conversion
gone wrong, and training on what is left would hide it.

Records are yielded as ``{"messages", "tools", "source_row", ...the row's other fields}``;
``source_row`` says where the record came from, so an error rendering it can name it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.builtins.data_sources import _EpochSource
from miles_core.components import DataSource
from miles_core.errors import MilesUserError

#: Keys of a message that Arrow fills with null when another row's message has them.
_OPTIONAL_KEYS = ("tool_calls", "reasoning_content", "tool_call_id", "name")


class ConversationsOptions(BaseModel):
    """Options of the ``conversations`` data source."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(..., description="a .jsonl or .parquet file of conversations")
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="auto: parquet for a .parquet or .pq file, else jsonl"
    )
    messages_key: str = Field("messages", description="field holding the list of messages")
    tools_key: str = Field("tools", description="field holding the tool schemas (optional)")
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")
    on_no_assistant: Literal["skip", "error"] = Field(
        "skip", description="skip (and count) conversations without an assistant turn, or refuse"
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _content_problem(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return None
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("text", ""), str):
                return f"[{j}]: expected a content part {{type, text}}, got {_kind(part)}"
        return None
    return f": expected text, null or a list of content parts, got {_kind(content)}"


def _tool_calls_problem(calls: Any) -> str | None:
    if not isinstance(calls, list):
        return f": expected a list of tool calls, got {_kind(calls)}"
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            return f"[{j}].function: expected an object with name and arguments"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"[{j}].function.name: expected a non-empty string, got {_kind(fn.get('name'))}"
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, (str, Mapping)):
            return f"[{j}].function.arguments: expected a JSON string or an object"
    return None


def message_problem(message: Any) -> str | None:
    """What is wrong with one chat message, as ``field: problem`` relative to the message, or
    ``None`` when it is well formed."""
    if not isinstance(message, Mapping):
        return f": expected an object with role and content, got {_kind(message)}"
    role = message.get("role")
    if not isinstance(role, str) or not role:
        return f".role: expected a non-empty string, got {_kind(role)}"
    problem = _content_problem(message.get("content"))
    if problem:
        return f".content{problem}"
    if message.get("tool_calls") is not None:
        problem = _tool_calls_problem(message["tool_calls"])
        if problem:
            return f".tool_calls{problem}"
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        return f".reasoning_content: expected text, got {_kind(reasoning)}"
    if role == "assistant" and not (
        message.get("content") or message.get("tool_calls") or reasoning
    ):
        return ": an assistant message needs content, tool_calls or reasoning_content"
    return None


def clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message without the optional keys a columnar file filled with null."""
    return {k: v for k, v in message.items() if not (k in _OPTIONAL_KEYS and v is None)}


def conversation_problem(
    row: Any, messages_key: str = "messages", tools_key: str = "tools"
) -> str | None:
    """What is wrong with a conversation row, naming the field, or ``None``."""
    if not isinstance(row, Mapping):
        return f"expected a JSON object with {messages_key!r}, got {_kind(row)}"
    if messages_key not in row:
        return f"no {messages_key!r} field (fields: {', '.join(map(str, row)) or 'none'})"
    messages = row[messages_key]
    if not isinstance(messages, list) or not messages:
        return f"{messages_key}: expected a non-empty list of messages, got {_kind(messages)}"
    for i, message in enumerate(messages):
        problem = message_problem(message)
        if problem:
            return f"{messages_key}[{i}]{problem}"
    tools = row.get(tools_key)
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        return f"{tools_key}: expected a list of tool schemas (objects), got {_kind(tools)}"
    return None


def has_assistant_turn(messages: list[Any]) -> bool:
    """Whether any message is an assistant turn (the only ones trained on)."""
    return any(m.get("role") == "assistant" for m in messages)


class ConversationsSource(_EpochSource):
    """Conversations from a JSON Lines or Parquet file (see the module docstring), yielded in
    a seeded order per epoch; the position is resumable and ``skipped`` counts the
    conversations without an assistant turn."""

    def __init__(self, options: ConversationsOptions) -> None:
        super().__init__()
        self.conversations = options
        self.options = options  # type: ignore[assignment]  # shuffle, seed, epochs
        self.path = Path(options.path)
        if not self.path.is_file():
            raise MilesUserError(f"data.path: file {options.path!r} does not exist")
        fmt = options.format
        if fmt == "auto":
            fmt = "parquet" if self.path.suffix in (".parquet", ".pq") else "jsonl"
        self.rows: list[dict[str, Any]] = []
        self.skipped = 0
        self._first_skipped: str | None = None
        rows = self._parquet_rows() if fmt == "parquet" else self._jsonl_rows()
        for where, row in rows:
            self._add(where, row)
        if not self.rows:
            detail = f"{self.skipped} without an assistant turn" if self.skipped else "it is empty"
            raise MilesUserError(
                f"data file {options.path!r} has no conversation to train on ({detail})"
            )
        if self._first_skipped:
            print(
                f"miles: warning: data file {options.path!r}: skipped {self.skipped} "
                f"conversation{'s' * (self.skipped != 1)} without an assistant turn (the first "
                f"at {self._first_skipped}); set on_no_assistant: error to refuse them instead",
                file=sys.stderr,
                flush=True,
            )

    def _jsonl_rows(self) -> Any:
        with self.path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise MilesUserError(
                        f"data.path {self.conversations.path!r} {where}: not valid JSON ({exc})"
                    ) from None
                yield where, row

    def _parquet_rows(self) -> Any:
        try:
            import datasets  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            raise MilesUserError(
                "data source 'conversations' needs the datasets library to read Parquet: "
                "pip install 'miles-core[datasets]'"
            ) from None
        try:
            dataset = datasets.Dataset.from_parquet(str(self.path))
        except Exception as exc:  # not Parquet, or unreadable
            raise MilesUserError(
                f"data file {self.conversations.path!r}: cannot be read as Parquet: {exc}"
            ) from None
        for i, row in enumerate(dataset):
            yield f"row {i + 1}", row

    def _add(self, where: str, row: Any) -> None:
        o = self.conversations
        if isinstance(row, Mapping):
            row = dict(row)
            if isinstance(row.get(o.messages_key), list):
                row[o.messages_key] = [
                    clean_message(m) if isinstance(m, Mapping) else m for m in row[o.messages_key]
                ]
            if isinstance(row.get(o.tools_key), str):  # tool schemas kept as JSON text
                try:
                    row[o.tools_key] = json.loads(row[o.tools_key])
                except json.JSONDecodeError:
                    raise MilesUserError(
                        f"data.path {o.path!r} {where}: {o.tools_key}: not valid JSON"
                    ) from None
        problem = conversation_problem(row, o.messages_key, o.tools_key)
        if problem:
            raise MilesUserError(f"data.path {o.path!r} {where}: {problem}")
        messages = row[o.messages_key]
        if not has_assistant_turn(messages):
            if o.on_no_assistant == "error":
                raise MilesUserError(
                    f"data.path {o.path!r} {where}: the conversation has no assistant turn "
                    "(nothing to train on)"
                )
            self.skipped += 1
            self._first_skipped = self._first_skipped or where
            return
        record = {k: v for k, v in row.items() if k not in (o.messages_key, o.tools_key)}
        record.update(messages=messages, source_row=f"{where} of {o.path}")
        if row.get(o.tools_key) is not None:
            record["tools"] = row[o.tools_key]
        self.rows.append(record)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict[str, Any]:
        """Conversation ``i`` of the usable ones."""
        return self.rows[i]


@hookimpl
def miles_register_data_sources(register):  # type: ignore[no-untyped-def]
    register(
        DataSource(
            name="conversations",
            factory=ConversationsSource,
            config=ConversationsOptions,
            description="chat conversations (messages, tools) from a JSON Lines or Parquet file",
        )
    )
