"""The checks of the engine gate on a finished scripted session (the list is in
:mod:`miles_modelfamilies.engine_gate`): what the session appended and generated against the
family's canonical render, turn by turn, then the session as a whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_core.families.report import GateFailure, GateReport, first_difference, show_difference
from miles_modelfamilies.family import TemplateFamily

GATE = "engine"


@dataclass
class _Tally:
    """What the turns of a session showed beside their failures."""

    text_drift: list[str] = field(default_factory=list)
    token_drift: list[int] = field(default_factory=list)
    engine_calls: int = 0
    unstopped: list[int] = field(default_factory=list)


def _fail(report: GateReport, check: str, turn: int, role: str, detail: str) -> None:
    report.failures.append(GateFailure(GATE, "scripted_session", check, turn, role, detail))


def _specials(ids: list[int], special: frozenset[int]) -> list[int]:
    return [i for i in ids if i in special]


def _name(family: TemplateFamily, ids: Sequence[int], at: int) -> str:
    """``'<tool_call>' (151657)`` for ``ids[at]``, or ``<end>`` past the end."""
    return f"{family.decode([ids[at]])!r} ({ids[at]})" if at < len(ids) else "<end>"


def _check_appended(
    family: TemplateFamily,
    n: int,
    turn: Any,
    prompt: str,
    before: tuple[str, str],
    report: GateReport,
) -> None:
    """``engine_text`` and ``engine_tokens`` of what turn ``n`` appended before its reply;
    ``before`` is the previous turn's render and closing."""
    prev_render, prev_closing = before
    ctx = turn.messages[:-1]
    where, role = len(ctx) - 1, ctx[-1]["role"]
    if not prompt.startswith(prev_render):
        at = first_difference(prev_render, prompt)
        _fail(
            report,
            "engine_text",
            where,
            role,
            f"turn {n}: the render before this "
            f"request is not a prefix of the render with it. First difference at {at}:\n"
            + show_difference("before", prev_render, "now", prompt, at),
        )
    env_text = prev_closing + prompt[len(prev_render) :]
    stored = family.decode(turn.env_ids)
    if stored != env_text:
        at = first_difference(stored, env_text)
        _fail(
            report,
            "engine_text",
            where,
            role,
            f"turn {n}: the text the session "
            f"appended is not the canonical text before the reply. First difference at "
            f"character {at}:\n" + show_difference("stored", stored, "canonical", env_text, at),
        )
    expected_ids = family.tokenize(env_text)
    if list(turn.env_ids) != expected_ids:
        at = first_difference(list(turn.env_ids), expected_ids)  # type: ignore[arg-type]
        _fail(
            report,
            "engine_tokens",
            where,
            role,
            f"turn {n}: the appended tokens "
            f"are not the tokenization of the canonical text; first difference at token "
            f"{at}: {list(turn.env_ids)[at : at + 6]} vs {expected_ids[at : at + 6]}",
        )


def _check_reply(
    family: TemplateFamily,
    n: int,
    turn: Any,
    canonical_reply: str,
    report: GateReport,
    tally: _Tally,
) -> None:
    """``engine_tokens`` of turn ``n``'s generated reply; its drift, tool calls and stop."""
    special = family.tokenizer.special_ids()
    where = len(turn.messages) - 1
    generated = family.decode(turn.gen_ids)
    got = _specials(list(turn.gen_ids) + family.tokenize(turn.closing), special)
    want = _specials(family.tokenize(canonical_reply), special)
    if got != want:
        at = first_difference(got, want)  # type: ignore[arg-type]
        _fail(
            report,
            "engine_tokens",
            where,
            "assistant",
            f"turn {n}: the special tokens of the generated reply (plus closing) are not "
            f"those of its canonical render; first difference at special token {at}: "
            f"{_name(family, got, at)} vs {_name(family, want, at)} (generated "
            f"{[family.decode([i]) for i in got]}, canonical "
            f"{[family.decode([i]) for i in want]})",
        )
    if generated + turn.closing != canonical_reply:
        at = first_difference(generated + turn.closing, canonical_reply)
        tally.text_drift.append(
            f"turn {n} at character {at}:\n"
            + show_difference(
                "generated", generated + turn.closing, "canonical", canonical_reply, at
            )
        )
    if list(turn.gen_ids) != family.tokenize(generated):
        tally.token_drift.append(n)
    tally.engine_calls += len((turn.reply or {}).get("tool_calls") or [])
    ids = turn.gen_ids
    if not (turn.finish_reason == "stop" and ids and ids[-1] in family.stop_token_ids):
        tally.unstopped.append(n)


def _check_session_end(
    family: TemplateFamily,
    session: Any,
    tally: _Tally,
    *,
    scripted: bool,
    expect_tool_call: bool,
    report: GateReport,
) -> None:
    """``engine_stop``, ``engine_tool_call``, ``engine_rollback`` and ``engine_whole``."""
    if scripted and tally.unstopped:
        _fail(
            report,
            "engine_stop",
            -1,
            "",
            f"replies of turns {tally.unstopped} did not end with a stop token "
            f"{list(family.stop_tokens)}",
        )
    held = sum(
        len(m.get("tool_calls") or []) for m in session.tip.messages if m["role"] == "assistant"
    )
    if expect_tool_call and tally.engine_calls == 0:
        _fail(
            report,
            "engine_tool_call",
            -1,
            "",
            "the scripted model's replies parsed to no tool call",
        )
    elif held == 0:
        _fail(report, "engine_tool_call", -1, "", "the session holds no tool call")
    if session.rollbacks != 1:
        _fail(
            report,
            "engine_rollback",
            -1,
            "",
            f"the retried turn was not rolled back (rollbacks = {session.rollbacks})",
        )
    if tally.text_drift or tally.token_drift:
        return
    whole = family.render(session.tip.messages, tools=session.tools)
    stored = session.tip.token_ids() + family.tokenize(session.tip.closing)
    canonical = family.tokenize(whole)
    if stored != canonical:
        at = first_difference(stored, canonical)  # type: ignore[arg-type]
        _fail(
            report,
            "engine_whole",
            -1,
            "",
            f"the stored tokens are not tokenize(render(whole)); "
            f"first difference at token {at}: {stored[at : at + 6]} vs "
            f"{canonical[at : at + 6]}",
        )


def check_session(
    family: TemplateFamily,
    session: Any,
    *,
    scripted: bool,
    report: GateReport,
    expect_tool_call: bool | None = None,
) -> dict[str, Any]:
    """Run the checks on a finished session (see :mod:`miles_modelfamilies.engine_gate`);
    failures go into ``report``; returns the details (drift counts and differences)."""
    tools = session.tools
    path = session.tip.path()
    details: dict[str, Any] = {"turns": len(path), "rollbacks": session.rollbacks}
    tally = _Tally()
    before = ("", "")
    for n, t in enumerate(path, start=1):
        prompt = family.render(t.messages[:-1], tools=tools, add_generation_prompt=True)
        after = family.render(t.messages, tools=tools)
        _check_appended(family, n, t, prompt, before, report)
        before = (after, t.closing)
        if not after.startswith(prompt):
            _fail(
                report,
                "engine_text",
                len(t.messages) - 1,
                "assistant",
                f"turn {n}: the render with the reply does "
                "not start with the render with the generation prompt",
            )
            continue
        _check_reply(family, n, t, after[len(prompt) :], report, tally)
    details.update(
        text_drift_turns=len(tally.text_drift),
        token_drift_turns=len(tally.token_drift),
        drift=tally.text_drift,
        engine_tool_calls=tally.engine_calls,
        replies_without_stop_token=tally.unstopped,
    )
    _check_session_end(
        family,
        session,
        tally,
        scripted=scripted,
        expect_tool_call=scripted if expect_tool_call is None else expect_tool_call,
        report=report,
    )
    return details
