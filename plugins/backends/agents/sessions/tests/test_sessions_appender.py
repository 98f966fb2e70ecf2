"""The tokenization path without an engine: the render window equals the full render on every
conversation shape of the family gate, a template that is not append-only is refused loudly,
and a canonical generated turn is recognised as such."""

from __future__ import annotations

from typing import Any

import pytest
from miles_sessions.appender import Appender, NotAppendOnly
from miles_sessions.store import Session, SessionError

from miles_core.families.shapes import SHAPES


def _family(name: str) -> Any:
    from miles_modelfamilies.options import Qwen3Options

    if name == "smollm2":
        from miles_modelfamilies.smollm2 import build as build_smollm2

        return build_smollm2(None)
    from miles_modelfamilies.qwen3 import build

    return build(Qwen3Options(enable_thinking=name == "qwen3"))


@pytest.mark.parametrize("name", ["qwen3", "qwen3-no-thinking", "smollm2"])
def test_sessions_window_equals_full_render(name: str) -> None:
    family = _family(name)
    window = Appender(family, window="turn")
    full = Appender(family, window="full")
    checked = 0
    for shape in SHAPES:
        if shape.roles - set(family.roles) or (shape.has_reasoning and not family.thinking):
            continue
        messages, tools = shape.conversation(), shape.tool_schemas()
        end_of_last_turn = 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            history, new = messages[:end_of_last_turn], messages[end_of_last_turn:k]
            if new:
                a = window.append(history, new, tools, closing="\n" if history else "")
                b = full.append(history, new, tools, closing="\n" if history else "")
                assert a.text == b.text, (shape.name, k)
                assert a.ids == b.ids
                checked += 1
            end_of_last_turn = k + 1
    assert checked >= 30


def _turn_ids(family: Any, text: str) -> list[int]:
    return family.tokenize(text)


def test_sessions_canonical_turn_and_refusal_of_a_non_append_only_template() -> None:
    from miles_modelfamilies.options import Qwen3Options
    from miles_modelfamilies.qwen3 import build

    for template, refused in (("keep-reasoning", False), ("original", True)):
        family = build(Qwen3Options(template=template))
        session = Session("s", "linear", Appender(family))
        first = [{"role": "user", "content": "Is 91 prime?"}]
        pending = session.prepare(first, None)
        assert family.decode(pending.input_ids) == family.render(first, add_generation_prompt=True)
        out = _turn_ids(family, "<think>\n91 = 7 * 13.\n</think>\n\nNo.<|im_end|>")
        turn = session.commit(
            pending,
            output_ids=out,
            logprobs=[-0.5] * len(out),
            finish_reason="stop",
            weight_version="3",
        )
        # A turn generated exactly as the template renders it is canonical.
        assert turn.canonical and turn.closing == "\n"
        assert turn.reply == {
            "role": "assistant",
            "content": "No.",
            "reasoning_content": "91 = 7 * 13.",
        }
        nxt = [*first, {"role": "assistant", "content": "No."}, {"role": "user", "content": "97?"}]
        if refused:
            # Qwen3's original template drops the earlier reasoning once a user message
            # follows: the stored tokens no longer match it. Refused, naming the difference.
            with pytest.raises(SessionError) as info:
                session.prepare(nxt, None)
            assert info.value.status == 409
            assert "not append-only" in info.value.message
            assert "91 = 7 * 13." in info.value.message
        else:
            pending = session.prepare(nxt, None)
            whole = family.render([*first, turn.reply, nxt[-1]], add_generation_prompt=True)
            # Stored prompt + generated + appended = the canonical render, token for token.
            assert pending.input_ids == family.tokenize(whole)


def test_sessions_appender_refuses_directly() -> None:
    from miles_modelfamilies.options import Qwen3Options
    from miles_modelfamilies.qwen3 import build

    family = build(Qwen3Options(template="original"))
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
    ]
    with pytest.raises(NotAppendOnly, match="not append-only"):
        Appender(family).append(history, [{"role": "user", "content": "c"}], None)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-no-thinking", "smollm2"])
def test_sessions_canonical_model_stores_the_canonical_render(name: str) -> None:
    """A model that generates every assistant turn exactly as the template renders it: over
    every gate shape, each turn is recognised as canonical and the stored tokens are, token for
    token, the tokens of the whole conversation's render."""
    family = _family(name)
    stops = tuple(family.decode([i]) for i in family.stop_token_ids)
    checked = 0
    for shape in SHAPES:
        if shape.roles - set(family.roles) or (shape.has_reasoning and not family.thinking):
            continue
        messages, tools = shape.conversation(), shape.tool_schemas()
        session = Session(shape.name, "linear", Appender(family, verify_window=True))
        last = None
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k == 0:
                continue
            pending = session.prepare(messages[:k], tools)
            prompt = family.render(messages[:k], tools=tools, add_generation_prompt=True)
            turn_text = family.render(messages[: k + 1], tools=tools)[len(prompt) :]
            cut = max(turn_text.rfind(s) + len(s) for s in stops if s in turn_text)
            out = family.tokenize(turn_text[:cut])
            turn = session.commit(
                pending,
                output_ids=out,
                logprobs=[0.0] * len(out),
                finish_reason="stop",
                weight_version="1",
            )
            assert turn.canonical, (shape.name, k, turn.difference)
            last = k
            checked += 1
        if last is None:
            continue
        sample = session.samples()[0]
        whole = family.tokenize(family.render(messages[: last + 1], tools=tools))
        stored = sample.prompt_ids + sample.response_ids
        assert stored + family.tokenize(session.tip.closing) == whole, shape.name
    assert checked >= 20


@pytest.mark.parametrize("name", ["qwen3", "qwen3-no-thinking", "smollm2"])
def test_sessions_store_what_sft_renders(name: str) -> None:
    """SFT data and RL rollouts tokenize the same way: a session whose model writes every
    assistant turn canonically stores, over every gate shape, exactly the prompt, the tokens and
    the loss mask that SFT renders from the same conversation (miles_core.rendering)."""
    from miles_core.rendering import render_conversation

    family = _family(name)
    stops = tuple(family.decode([i]) for i in family.stop_token_ids)
    checked = 0
    for shape in SHAPES:
        if shape.roles - set(family.roles) or (shape.has_reasoning and not family.thinking):
            continue
        messages, tools = shape.conversation(), shape.tool_schemas()
        if messages[0]["role"] == "assistant":
            continue  # a session's first request has a message before the reply
        session = Session(shape.name, "linear", Appender(family))
        last = None
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            pending = session.prepare(messages[:k], tools)
            prompt = family.render(messages[:k], tools=tools, add_generation_prompt=True)
            turn_text = family.render(messages[: k + 1], tools=tools)[len(prompt) :]
            cut = max(turn_text.rfind(s) + len(s) for s in stops if s in turn_text)
            out = family.tokenize(turn_text[:cut])
            session.commit(
                pending,
                output_ids=out,
                logprobs=[0.0] * len(out),
                finish_reason="stop",
                weight_version="1",
            )
            last = k
        if last is None:
            continue
        stored = session.samples()[0]
        rendered = render_conversation(family, messages[: last + 1], tools=tools)
        assert stored.prompt_ids == rendered.prompt_ids, shape.name
        assert stored.response_ids == rendered.response_ids, shape.name
        assert stored.loss_mask == rendered.loss_mask, shape.name
        checked += 1
    assert checked >= 10, checked


def test_sessions_turn_costs_two_renders() -> None:
    """The reply's render after the header is the next request's window: from the second
    turn on, a turn renders twice (appended messages, reply), like the first turn."""
    from miles_modelfamilies.qwen3 import build

    family = build()
    calls = []
    render = family.render

    def counted(*a: Any, **k: Any) -> str:
        calls.append(1)
        return render(*a, **k)

    family.render = counted  # type: ignore[method-assign]
    session = Session("s", "linear", Appender(family))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]
    per_turn = []
    out = family.tokenize("<think>\nr\n</think>\n\nok<|im_end|>")
    for t in range(6):
        calls.clear()
        pending = session.prepare(messages, None)
        turn = session.commit(
            pending,
            output_ids=out,
            logprobs=[0.0] * len(out),
            finish_reason="stop",
            weight_version="0",
        )
        per_turn.append(len(calls))
        messages += [turn.reply, {"role": "user", "content": f"u{t}"}]
    # First turn: appended messages, reply, and the header's generation prompt (cached after).
    assert per_turn == [3, 2, 2, 2, 2, 2]


def test_sessions_routed_experts_follow_the_tokens() -> None:
    """SGLang's routing record of each turn (base64 int32, every forwarded position of its
    request) is spliced into one record of the whole sample: each position keeps the row of
    the turn that forwarded it first, the one whose forward produced the next token. A
    record of the wrong length is refused; a turn without one leaves the sample without."""
    import base64

    import numpy as np
    from miles_modelfamilies.qwen3 import build

    family = build()
    out = family.tokenize("<think>\nr\n</think>\n\nok<|im_end|>")

    def record(turn: int, positions: int) -> str:
        # row p of turn t: [t, p] (one layer, top-2)
        ids = np.array([[turn, p % 100] for p in range(positions)], dtype="<i4")
        return base64.b64encode(ids.tobytes()).decode()

    def run(skip: int | None) -> Any:
        session = Session("s", "linear", Appender(family))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "u"}]
        for t in range(3):
            pending = session.prepare(messages, None)
            forwarded = len(pending.input_ids) + len(out) - 1
            turn = session.commit(
                pending,
                output_ids=out,
                logprobs=[-0.1] * len(out),
                finish_reason="stop",
                weight_version=str(t),
                routed_experts=None if t == skip else record(t, forwarded),
            )
            messages += [turn.reply, {"role": "user", "content": f"u{t}"}]
        (sample,) = session.samples()
        return session, sample

    session, sample = run(None)
    sample.check()
    routed = sample.routed_experts
    assert routed is not None and routed.itemsize == 1 and routed.width == 2
    rows = routed.rows()
    assert [r[1] for r in rows] == [p % 100 for p in range(len(rows))]  # every position, in order
    # the turn each position was first forwarded by: the prompt and turn 0's reply (but its
    # last token) by turn 0; then each later turn's appended tokens and reply
    mask = sample.loss_mask
    gen_ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    ends = [len(sample.prompt_ids) + e for e in gen_ends]  # position of each turn's last token
    owner = [next(t for t, e in enumerate(ends) if p < e) for p in range(len(rows))]
    assert [r[0] for r in rows] == owner

    _, without = run(1)
    assert without.routed_experts is None  # a turn without a record: no record of the path

    session = Session("s", "linear", Appender(family))
    pending = session.prepare([{"role": "user", "content": "u"}], None)
    with pytest.raises(SessionError, match="routed_experts cover no"):
        session.commit(
            pending,
            output_ids=out,
            logprobs=[-0.1] * len(out),
            finish_reason="stop",
            weight_version="0",
            routed_experts=record(0, len(pending.input_ids) + len(out) - 2),
        )
