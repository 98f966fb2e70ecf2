"""The CPU gate: the family's chat template only ever appends, in text and in tokens.

The session server stores the exact tokens of every turn and tokenizes only what a new request
appends. That is correct only if, for every conversation, rendering an earlier point of it is an
exact prefix of rendering the whole, and tokenizing the appended text piece by piece gives the
same ids as tokenizing the whole render (the *canonical* tokens a trainer would compute).

A conversation is cut at *turn boundaries*: right after an assistant turn (what a session has
stored when the next request arrives) and right before one (where the generation prompt goes).
Messages between two assistant turns arrive in one request — an assistant turn with parallel
tool calls is answered by all of its results at once — so a template may render them as one
block (Qwen3 wraps consecutive tool results in a single user turn). ``boundaries="message"``
cuts after every message instead, for templates that promise more.

Four checks at each cut of each shape:

* ``prefix``: ``render(messages[:k])`` is a prefix of ``render(messages)``;
* ``generation_prompt``: before an assistant turn, ``render(messages[:k],
  add_generation_prompt=True)`` is a prefix of ``render(messages)``, so the prompt the engine
  continues from is exactly where the stored turn begins;
* ``tokens``: the concatenated tokens of the successive appended pieces equal
  ``tokenize(render(messages))``;
* ``parse``: the text of each assistant turn (what follows its generation prompt, as the engine
  would generate it) goes through ``parse_assistant`` back to the same content, reasoning and
  tool calls, and the parsed turn renders to the same text: the parsers and the template agree.

The gate reads only what the :class:`miles_core.contracts.Family` protocol declares (render,
parse, ``tokenize``, ``decode``, ``roles``, ``thinking``, ``always_reasons``,
``system_anywhere``); it imports no torch and no tokenizer library.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from miles_core.contracts import Family
from miles_core.families.report import (
    CONTEXT_CHARS,
    GateFailure,
    GateReport,
    first_difference,
    quote_at,
    show_difference,
)
from miles_core.families.shapes import SHAPES, ConversationShape, Message

Boundaries = Literal["turn", "message"]
GATE = "cpu"


def cut_points(messages: Sequence[Message], boundaries: Boundaries = "turn") -> list[int]:
    """Prefix lengths ``k`` (``0 < k < len(messages)``) at which the conversation is cut."""
    cuts = []
    for k in range(1, len(messages)):
        if boundaries == "message" or "assistant" in (
            messages[k - 1]["role"],
            messages[k]["role"],
        ):
            cuts.append(k)
    return cuts


def _applicable(family: Family, shape: ConversationShape) -> str | None:
    """Why ``shape`` does not apply to ``family``, or ``None``."""
    missing = sorted(shape.roles - set(family.roles))
    if missing:
        return f"uses role(s) {', '.join(missing)} that the family does not render"
    if not family.system_anywhere and any(m["role"] == "system" for m in shape.messages[1:]):
        return "has a system message after the first message, which the family's template refuses"
    if shape.has_reasoning and not family.thinking:
        return "has reasoning turns but the family renders with thinking off"
    return None


#: Reasoning given to assistant turns without any, for families that always reason.
FILLER_REASONING = "Let me think about this."


def conversation_for(family: Family, shape: ConversationShape) -> list[Message]:
    """The messages of ``shape`` as the gate renders them for ``family``.

    A family whose generation prompt opens the reasoning block (``always_reasons = True``:
    Qwen3.5, Qwen3-2507 thinking) cannot hold an assistant turn with *empty* reasoning
    canonically: the prompt ends ``<think>\\n`` and the render of the empty block continues with
    ``\\n</think>``, and the two newlines tokenize as one token in the whole render but as two
    across the prompt boundary. Such a model always writes reasoning, so assistant turns without
    any get :data:`FILLER_REASONING`.
    """
    messages = shape.conversation()
    if family.always_reasons:
        for m in messages:
            if m["role"] == "assistant" and not (m.get("reasoning_content") or "").strip():
                m["reasoning_content"] = FILLER_REASONING
    return messages


def _where(messages: Sequence[Message], k: int) -> tuple[int, str]:
    return k, messages[k]["role"]


def _prefix_detail(messages: Sequence[Message], k: int, prefix: str, whole: str) -> str:
    """Why the render of ``messages[:k]`` is not a prefix of the whole render."""
    at = first_difference(prefix, whole)
    return (
        f"rendering messages[0:{k}] (ending with this {messages[k - 1]['role']} turn) is not a "
        f"prefix of rendering all {len(messages)} messages; appending "
        f"{messages[k]['role']!r} changed what was already rendered. First difference "
        f"at character {at}:\n" + show_difference("prefix", prefix, "whole", whole, at)
    )


def _prompt_detail(n: int, k: int, prompt: str, whole: str) -> str:
    """Why the render of ``messages[:k]`` with the generation prompt is not a prefix of the
    whole render of ``n`` messages."""
    at = first_difference(prompt, whole)
    return (
        f"rendering messages[0:{k}] with the generation prompt is not a prefix of "
        f"rendering all {n} messages: the assistant turn is not stored where the "
        f"engine continued from. First difference at character {at}:\n"
        + show_difference("prompt", prompt, "whole", whole, at)
    )


def check_shape(
    family: Family, shape: ConversationShape, *, boundaries: Boundaries = "turn"
) -> tuple[int, list[GateFailure]]:
    """Run the four checks on one shape; returns (number of checks, failures)."""
    messages = conversation_for(family, shape)
    failures: list[GateFailure] = []
    checks = 0

    def fail(check: str, k: int, detail: str) -> None:
        turn, role = _where(messages, k) if 0 <= k < len(messages) else (-1, "")
        failures.append(GateFailure(GATE, shape.name, check, turn, role, detail))

    def render(k: int, generation: bool = False) -> str | None:
        try:
            out = family.render(
                conversation_for(family, shape)[:k],
                tools=shape.tool_schemas(),
                add_generation_prompt=generation,
            )
        except Exception as exc:  # a template error is a gate failure, not a crash
            fail("render", k - 1, f"rendering messages[0:{k}] raised {type(exc).__name__}: {exc}")
            return None
        if not isinstance(out, str):
            fail("render", k - 1, f"render returned {type(out).__name__}, not str")
            return None
        return out

    def render_messages(msgs: list[Message]) -> str:
        return str(family.render(msgs, tools=shape.tool_schemas(), add_generation_prompt=False))

    whole = render(len(messages))
    if whole is None:
        return 1, failures
    n = len(messages)
    # Text offsets at which the session appends, in conversation order.
    pieces: list[tuple[int, int, str]] = []  # (offset, message index, what is appended there)
    prompts: dict[int, str] = {}  # assistant index -> render with the generation prompt
    for k in cut_points(messages, boundaries):
        checks += 1
        prefix = render(k)
        if prefix is None:
            continue
        if whole.startswith(prefix):
            pieces.append((len(prefix), k, "messages"))
        else:
            fail("prefix", k - 1, _prefix_detail(messages, k, prefix, whole))
        if messages[k]["role"] == "assistant":
            checks += 1
            prompt = render(k, generation=True)
            if prompt is None:
                continue
            if whole.startswith(prompt):
                pieces.append((len(prompt), k, "generation prompt"))
                prompts[k] = prompt
            else:
                fail("generation_prompt", k, _prompt_detail(n, k, prompt, whole))
    checks += 1
    failures.extend(_check_tokens(family, shape, messages, whole, pieces))
    for k, prompt in prompts.items():
        after = whole if k + 1 == n else render(k + 1)
        if after is None or not after.startswith(prompt):
            continue  # already reported by the prefix check
        checks += 1
        detail = _check_parse(family, messages, k, prompt, after, render_with=render_messages)
        if detail:
            fail("parse", k, detail)
    return checks, failures


def _tool_calls(calls: Any) -> list[tuple[str, Any]]:
    """(name, arguments as JSON value) of OpenAI-format tool calls, for comparison."""
    out = []
    for call in calls or []:
        fn = call.get("function", call)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append((fn.get("name"), arguments))
    return out


def _check_parse(
    family: Family,
    messages: Sequence[Message],
    k: int,
    prompt: str,
    after: str,
    *,
    render_with: Callable[[list[Message]], str],
) -> str | None:
    """The generated text of assistant turn ``k`` (what follows the generation prompt) parses
    back into the same content, reasoning and tool calls, and the parsed turn renders to the
    same text. Returns what went wrong, or ``None``."""
    generated = after[len(prompt) :]
    try:
        parsed = family.parse_assistant(generated)
    except Exception as exc:  # a parser crash is a failure of this turn
        return f"parse_assistant raised {type(exc).__name__}: {exc} on {generated[:80]!r}"
    original = messages[k]
    problems = []
    if (parsed.get("content") or "").strip() != (original.get("content") or "").strip():
        problems.append(f"content {parsed.get('content')!r} != {original.get('content')!r}")
    if family.thinking:
        got, want = parsed.get("reasoning_content") or "", original.get("reasoning_content") or ""
        if got.strip() != want.strip():
            problems.append(f"reasoning {parsed.get('reasoning_content')!r} != {want!r}")
    if _tool_calls(parsed.get("tool_calls")) != _tool_calls(original.get("tool_calls")):
        problems.append(
            f"tool calls {_tool_calls(parsed.get('tool_calls'))!r} != "
            f"{_tool_calls(original.get('tool_calls'))!r}"
        )
    if problems:
        return (
            "parse_assistant on the generated text of this turn does not give the turn back: "
            + "; ".join(problems)
            + f". Generated text: {generated[: 2 * CONTEXT_CHARS]!r}"
        )
    rebuilt: Message = {"role": "assistant", "content": parsed.get("content")}
    for key in ("reasoning_content", "tool_calls"):
        if parsed.get(key) is not None:
            rebuilt[key] = parsed[key]
    try:
        again = render_with([*messages[:k], rebuilt])
    except Exception as exc:
        return f"rendering the parsed turn raised {type(exc).__name__}: {exc}"
    if again != after:
        at = first_difference(again, after)
        return (
            "the parsed turn renders differently from the turn it was parsed from, so the "
            f"session would store text the render does not reproduce. First difference at "
            f"character {at}:\n" + show_difference("parsed", again, "original", after, at)
        )
    return None


def _check_tokens(
    family: Family,
    shape: ConversationShape,
    messages: Sequence[Message],
    whole: str,
    pieces: list[tuple[int, int, str]],
) -> list[GateFailure]:
    tokenize = family.tokenize
    canonical = list(tokenize(whole))
    incremental: list[int] = []
    owners: list[tuple[int, int, int, str]] = []  # per token: (piece start, end, message, kind)
    start, start_k, kind = 0, 0, "messages"
    for end, k, next_kind in [*sorted(pieces), (len(whole), len(messages), "end")]:
        if end < start:  # cannot happen when every piece is a prefix of the whole; be safe
            continue
        ids = list(tokenize(whole[start:end]))
        incremental.extend(ids)
        owners.extend([(start, end, start_k, kind)] * len(ids))
        start, start_k, kind = end, k, next_kind
    if incremental == canonical:
        return []
    i = first_difference(incremental, canonical)  # type: ignore[arg-type]
    begin, end, k, what = owners[min(i, len(owners) - 1)] if owners else (0, 0, 0, "messages")

    def around(ids: list[int]) -> str:
        window = ids[max(0, i - 3) : i + 4]
        return f"{window} = {[family.decode([t]) for t in window]!r}"

    k = min(k, len(messages) - 1)
    piece = "the generation prompt" if what == "generation prompt" else f"message {k}"
    detail = (
        f"the text appended at {piece} (characters {begin}-{end}), tokenized on its own, does "
        f"not give the canonical tokens of the whole render; first differing token at index "
        f"{i}. Tokens around it:\n"
        f"    incremental: {around(incremental)}\n"
        f"    canonical:   {around(canonical)}\n"
        f"    piece starts: {quote_at(whole, begin)}\n"
        f"    piece ends:   {quote_at(whole, end)}"
    )
    return [GateFailure(GATE, shape.name, "tokens", k, messages[k]["role"], detail)]


def run_cpu_gate(
    family: Family,
    shapes: Iterable[ConversationShape] = SHAPES,
    *,
    boundaries: Boundaries = "turn",
    report: GateReport | None = None,
) -> GateReport:
    """Run the CPU gate over ``shapes`` and return (or extend) a :class:`GateReport`.

    The report names, for each failure, the shape, the turn, the check and the first differing
    characters with some context. Writes no certificate: see :func:`verify_family`.
    """
    started = time.perf_counter()
    if report is None:
        report = GateReport(family=family.name, fingerprint=family.fingerprint(), gates=(GATE,))
    for shape in shapes:
        why = _applicable(family, shape)
        if why is not None:
            report.skipped[shape.name] = why
            continue
        checks, failures = check_shape(family, shape, boundaries=boundaries)
        report.shapes.append(shape.name)
        report.checks += checks
        report.failures.extend(failures)
    report.seconds += time.perf_counter() - started
    return report
