"""Gate shapes beyond :data:`miles_core.families.SHAPES`: boundaries where the render joins two
turns with plain text, and the upstream project's own trajectories.

**Boundary shapes** (:data:`BOUNDARY_SHAPES`). The CPU gate's ``tokens`` check fails when the
tokens a session stores, piece by piece, are not the canonical tokens of the whole render. A
piece boundary is safe when a special token sits on it (``<|im_end|>``, ``<｜Assistant｜>``);
where a template writes one turn's text straight after another's, the first token of the new
turn can merge with the last of the old one. These shapes put a system message on each side of
an assistant turn with no user turn between: right after a tool result and right before the
answer (the upstream retry pattern), right after a user turn, right after an assistant turn. The
system text ends in ``.`` and the assistant's text starts with a word: DeepSeek V4's encoder
renders that as ``...step 2.Got ...``, whose whole tokens are ``'.G', 'ot'`` where the engine
generated ``'.', 'Got'``.

**Upstream trajectories** (:func:`upstream_shapes`). The multi-turn trajectories that the PyPI
package ``miles-tito-tokenizers`` tests its own templates with, read from the installed package
(a test extra of this distribution) and run as gate shapes.
"""

from __future__ import annotations

import json
from typing import Any

from miles_core.families.shapes import TOOLS, ConversationShape

Message = dict[str, Any]


def _call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _assistant(
    text: str, *, reasoning: str | None = None, calls: list[dict[str, Any]] | None = None
) -> Message:
    m: Message = {"role": "assistant", "content": text}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def _role(role: str, text: str) -> Message:
    return {"role": role, "content": text}


def _tool_then_system(thinking: bool) -> tuple[Message, ...]:
    """A tool call, its result, a system message, the answer (reasoning on each turn or none)."""
    first = "I need the weather of Oslo." if thinking else None
    last = "Got the result: it is cold." if thinking else None
    return (
        _role("user", "Weather in Oslo?"),
        _assistant("", reasoning=first, calls=[_call(0, "get_weather", {"city": "Oslo"})]),
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": -3}'},
        _role("system", "The tool answered. Now answer in one sentence."),
        _assistant("Got it: -3 °C in Oslo.", reasoning=last),
    )


def _system_between(before: Message, thinking: bool) -> tuple[Message, ...]:
    """``before`` (a user or an assistant turn), a system message, then an assistant turn."""
    reasoning = "Got the rule: be brief." if thinking else None
    start: tuple[Message, ...] = () if before["role"] == "user" else (_role("user", "Hi."),)
    return (
        *start,
        before,
        _role("system", "Reply in at most five words."),
        _assistant("Got it. Paris is the capital.", reasoning=reasoning),
    )


def _boundary_shapes() -> tuple[ConversationShape, ...]:
    out = []
    for thinking in (False, True):
        tail = "_thinking" if thinking else ""
        mode = " (reasoning on every assistant turn)" if thinking else ""
        greeting = _assistant("Hello.", reasoning="A greeting." if thinking else None)
        out += [
            ConversationShape(
                f"system_after_tool_result{tail}",
                "a system message right after a tool result and right before the answer" + mode,
                _tool_then_system(thinking),
                TOOLS,
            ),
            ConversationShape(
                f"system_after_user{tail}",
                "a system message between a user turn and the assistant's answer" + mode,
                _system_between(_role("user", "Capital of France?"), thinking),
            ),
            ConversationShape(
                f"system_after_assistant{tail}",
                "a system message right after an assistant turn, then another assistant turn"
                + mode,
                _system_between(greeting, thinking),
            ),
        ]
    return tuple(out)


#: Shapes where a system message meets an assistant turn with no user turn between.
BOUNDARY_SHAPES: tuple[ConversationShape, ...] = _boundary_shapes()


def upstream_shapes() -> tuple[ConversationShape, ...]:
    """The mock trajectories of ``miles-tito-tokenizers`` (every ``*Trajectory`` class its
    ``testing`` module exports: messages and tools as the package defines them) as gate shapes
    named ``tito_<ClassName>``. Raises ``RuntimeError`` naming the package when it is not
    installed (it is in this distribution's ``test`` extra)."""
    try:
        from miles_tito_tokenizers import testing  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "the upstream trajectories come from the miles-tito-tokenizers package: "
            "pip install 'miles-modelfamilies[test]' (or miles-tito-tokenizers)"
        ) from exc
    shapes = []
    for name in sorted(testing.__all__):
        if not name.endswith("Trajectory") or name == "Trajectory":
            continue
        cls = getattr(testing, name)
        tools = None if cls.TOOLS is None else tuple(cls.TOOLS)
        doc = (cls.__doc__ or name).strip()
        shapes.append(ConversationShape(f"tito_{name}", doc, tuple(cls.MESSAGES), tools))
    return tuple(shapes)
