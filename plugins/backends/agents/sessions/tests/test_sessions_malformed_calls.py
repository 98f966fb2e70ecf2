"""Malformed tool calls: a generated call whose JSON is broken or whose arguments do not match
the tool's schema reaches the harness as SGLang's and vLLM's servers report it (the raw text
kept), marked in ``miles.tool_call_errors``, counted, and the episode goes on."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from miles_core.runtime.metrics import group_metrics

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "integer"}, "unit": {"type": ["string", "null"]}},
    "required": ["city"],
    "additionalProperties": False,
}
STRICT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]


@pytest.mark.parametrize(
    "arguments,error",
    [
        ('{"city": 1}', None),
        ('{"city": 1.0, "unit": null}', None),
        ('{"city": 1, "unit": "C"}', None),
        ('{"city": "one"}', "argument 'city' is str, not integer"),
        ('{"city": true}', "argument 'city' is bool, not integer"),
        ('{"unit": "C"}', "missing required argument 'city'"),
        ('{"city": 1, "country": "x"}', "argument 'country' is not in the schema"),
        ("city=1", "not valid JSON"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_sessions_call_checked_against_the_schema(arguments: str, error: str | None) -> None:
    from miles_sessions.toolcalls import call_error

    call = {"type": "function", "function": {"name": "lookup", "arguments": arguments}}
    got = call_error(call, STRICT_TOOLS)
    assert got is None if error is None else (got is not None and error in got), got
    other = {"type": "function", "function": {"name": "search", "arguments": "{}"}}
    assert "no tool named 'search'" in (call_error(other, STRICT_TOOLS) or "")


def _turn_text(arguments: str) -> str:
    call = '{"name": "lookup", "arguments": ' + arguments + "}"
    return f"<think>ok</think>\n\n<tool_call>{call}</tool_call><|im_end|>"


def test_sessions_store_keeps_and_counts_malformed_calls(family: Any) -> None:
    """On the store, with the real qwen3 family: a call against the schema and a call whose
    arguments are a string that is not JSON stay calls with the generated text as arguments,
    are marked and counted; the Anthropic form of the second keeps its text, and sending either
    form back locates the stored turn."""
    from miles_sessions.anthropic_api import (
        RAW_ARGUMENTS,
        MessagesRequest,
        content_blocks,
        to_session,
    )
    from miles_sessions.appender import Appender
    from miles_sessions.store import Session

    session = Session("s", "linear", Appender(family))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    for turn, arguments in enumerate(['{"city": "one"}', '"city=1"'], start=1):
        pending = session.prepare(messages, STRICT_TOOLS)
        ids = family.tokenize(_turn_text(arguments))
        stored = session.commit(
            pending,
            output_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason="stop",
            weight_version="3",
        )
        call = stored.reply["tool_calls"][0]
        raw = json.loads(arguments) if arguments.startswith('"') else arguments
        assert call["function"]["arguments"] == raw
        [error] = stored.tool_call_errors
        assert error["index"] == 0 and error["id"] == call["id"] == f"call_{turn}_0"
        assert error["arguments"] == raw
        messages += [stored.reply, {"role": "tool", "tool_call_id": call["id"], "content": "?"}]
    assert "argument 'city' is str" in session.tip.parent.tool_call_errors[0]["error"]
    assert "not valid JSON" in session.tip.tool_call_errors[0]["error"]
    assert session.describe()["malformed_tool_calls"] == 2
    assert session.samples()[0].metadata["malformed_tool_calls"] == 2
    blocks = content_blocks(session.tip)
    assert blocks[-1]["input"] == {RAW_ARGUMENTS: "city=1"}
    # Sent back in Anthropic's form, the turn with the raw arguments is found in the store.
    convo = [
        {"role": "user", "content": "Weather in city 1?"},
        {"role": "assistant", "content": content_blocks(session.tip.parent)},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1_0", "content": "?"}],
        },
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": "go on"},
    ]
    translated, _ = to_session(MessagesRequest(max_tokens=8, messages=convo))
    base, new = session.locate(translated)
    assert base is session.tip and new == [{"role": "user", "content": "go on"}]


@pytest.fixture(scope="module")
def broken_server(loop_thread: Any, family: Any, broken_engine_url: str) -> Any:
    """A session server over the engine whose tool calls break half the time."""
    from miles_engine_client import EngineClient
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    async def start() -> tuple[Any, Any, str]:
        engine = EngineClient(broken_engine_url, timeout_s=120)
        server = SessionServer(family, engine, SessionServerOptions(max_new_tokens=48))
        return server, engine, await server.start()

    server, engine, url = loop_thread.run(start())
    yield server, url

    async def stop() -> None:
        await server.stop()
        await engine.close()

    loop_thread.run(stop())


def test_sessions_broken_tool_json_reaches_the_harness(
    broken_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    """The official OpenAI client sees a broken call as vLLM's and SGLang's servers report it:
    the raw text in ``content``, no tool call, ``finish_reason`` ``stop``; the ``miles`` object
    marks it, the session counts it, and the following turns (through either API) work."""
    _, url = broken_server
    sid = new_session(url)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    seen = {"broken": 0, "ok": 0}
    for turn in range(10):
        resp = client.chat.completions.create(
            model="m", messages=messages, tools=tools, seed=turn, max_tokens=48
        )
        choice, miles = resp.choices[0], resp.model_extra["miles"]
        msg = choice.message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            assert choice.finish_reason == "tool_calls" and miles["tool_call_errors"] == []
            assert json.loads(msg.tool_calls[0].function.arguments) == {"city": 1}
            messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "7"})
            seen["ok"] += 1
        else:
            assert choice.finish_reason == "stop"
            assert msg.content == '<tool_call>{"name":"lookup","arguments":{"city":1}</tool_call>'
            [error] = miles["tool_call_errors"]
            assert error["index"] is None and "did not parse" in error["error"]
            messages.append({"role": "user", "content": "Your tool call was not valid JSON."})
            seen["broken"] += 1
        if seen["broken"] >= 2 and seen["ok"] >= 1:
            break
    assert seen["broken"] >= 2 and seen["ok"] >= 1, seen
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["malformed_tool_calls"] == seen["broken"]
    assert state["turns"] == turn + 1 and state["branches"] == 1 and state["rollbacks"] == 0
    # The Anthropic client continues the same session: a broken call is a text block there.
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    for m in messages[1:]:
        if m["role"] == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": "ok", "signature": ""}]
            blocks += [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [
                {"type": "tool_use", "id": c["id"], "name": "lookup", "input": {"city": 1}}
                for c in m.get("tool_calls") or ()
            ]
            convo.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": "7"}
            convo.append({"role": "user", "content": [result]})
        else:
            convo.append({"role": "user", "content": m["content"]})
    ant = anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key="unused")
    anthropic_tools = [
        {
            "name": "lookup",
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in tools
    ]
    for seed in range(20, 40):
        reply = ant.messages.create(
            model="m",
            messages=convo,
            tools=anthropic_tools,
            max_tokens=48,
            extra_body={"seed": seed},
        )
        errors = reply.model_extra["miles"]["tool_call_errors"]
        if errors:
            break
        retry = httpx.get(f"{url}/sessions/{sid}").json()["rollbacks"]
        assert retry == seed - 19  # the same last messages again: the last turn is retried
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == [
        "thinking",
        "text",
    ]
    assert reply.content[1].text.startswith("<tool_call>") and errors[0]["index"] is None
    assert httpx.get(f"{url}/sessions/{sid}").json()["malformed_tool_calls"] == seen["broken"] + 1


@pytest.mark.parametrize("rule", ["continue", "end"])
def test_sessions_rollout_counts_broken_calls_and_goes_on(
    rule: str, family: Any, broken_engine_url: str, loop_thread: Any, tools: Any
) -> None:
    """The ``session`` rollout with the ``tool_loop`` agent over the breaking engine: with
    ``continue`` every episode runs its four turns past its broken calls and each sample counts
    them; with ``end`` an episode stops at its first broken call."""
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions
    from miles_sessions.rollout import build as build_rollout

    rollout = build_rollout(SessionRolloutOptions(max_turns=4, max_new_tokens=48))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
        "on_malformed_tool_call": rule,
    }

    def per_turn(sample: Any, prompt: Any) -> float:
        # a turn that called the tool well earns 0.1, one whose call was broken -0.1
        calls = [m for m in sample.metadata["messages"] if m["role"] == "assistant"]
        sample.turn_rewards = [0.1 if m.get("tool_calls") else -0.1 for m in calls][
            : len(sample.turns())
        ]
        return 1.0

    async def go() -> Any:
        async with EngineClient(broken_engine_url, timeout_s=120) as engine:
            try:
                return await rollout(
                    prompt,
                    group_size=4,
                    engine=engine,
                    reward=per_turn,
                    family=family,
                    step=3,
                )
            finally:
                await rollout.close()

    group = loop_thread.run(go(), timeout=300)
    assert len(group.samples) == 4 and not group.failed
    counts = [s.metadata["malformed_tool_calls"] for s in group.samples]
    assert sum(counts) >= 1, counts
    # each step's metrics sum them over its trained samples
    metrics = group_metrics([group])
    assert metrics["counts/malformed_tool_calls"] == float(sum(counts))
    for sample, count in zip(group.samples, counts, strict=True):
        turns = len(sample.metadata["turns"])
        # the per-turn reward scored each generated turn: the broken ones -0.1
        assert sample.turn_rewards is not None and len(sample.turn_rewards) == turns
        assert sample.turn_rewards.count(-0.1) == count
        msgs = sample.metadata["messages"]
        broken = [m for m in msgs if m["role"] == "assistant" and not m.get("tool_calls")]
        assert len(broken) == count
        if rule == "continue":
            assert turns == 4
            notes = [
                m for m in msgs if m["role"] == "user" and "could not be parsed" in m["content"]
            ]
            assert len(notes) == count - (msgs[-1] in broken)
        else:
            assert count <= 1 and (count == 0 or msgs[-1] in broken)
            assert turns == 4 if count == 0 else turns <= 4
