"""The official OpenAI client drives sessions with tools, whole and streamed, against a real
session server over a real embedded engine process."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai


def test_sessions_openai_tools_multi_turn(
    session_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    _, url = session_server
    sid = new_session(url)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["miles"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You look up the weather."},
        {"role": "user", "content": "Weather in city 1?"},
    ]
    kinds = []
    for turn in range(8):
        resp = client.chat.completions.create(
            model="miles", messages=messages, tools=tools, seed=turn, max_tokens=64
        )
        choice = resp.choices[0]
        msg = choice.message
        assert msg.model_extra["reasoning_content"] == "ok"
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            assert choice.finish_reason == "tool_calls"
            call = msg.tool_calls[0]
            assert call.function.name == "lookup"
            assert json.loads(call.function.arguments) == {"city": 1}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
            kinds.append("tool")
        else:
            assert choice.finish_reason == "stop"
            assert msg.content == "Done."
            messages.append({"role": "user", "content": f"And tomorrow ({turn})?"})
            kinds.append("text")
        assert resp.usage.completion_tokens == len(resp.model_extra["miles"]["completion_ids"])
    assert "tool" in kinds and "text" in kinds, kinds
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["turns"] == 8 and state["branches"] == 1 and state["rollbacks"] == 0
    samples = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"]
    assert len(samples) == 1
    assert len(samples[0]["metadata"]["turns"]) == 8
    # The scripted model writes `<think>ok</think>` where the template writes newlines around
    # the reasoning (and compact JSON where it writes spaced JSON): flagged, kept as generated.
    assert state["non_canonical_turns"] == 8


def test_sessions_openai_stream(
    session_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    _, url = session_server
    sid = new_session(url)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    kinds = []
    for turn in range(6):
        stream = client.chat.completions.create(
            model="miles",
            messages=messages,
            tools=tools,
            seed=100 + turn,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, reasoning, calls, finish, usage = "", "", {}, None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert reasoning == "ok" and usage is not None and usage.completion_tokens > 0
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assert finish == "tool_calls"
            call = calls[0]
            assert call["name"] == "lookup" and json.loads(call["arguments"]) == {"city": 1}
            assistant["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ]
            messages += [assistant, {"role": "tool", "tool_call_id": call["id"], "content": "7"}]
            kinds.append("tool")
        else:
            assert finish == "stop" and content == "Done."
            messages += [assistant, {"role": "user", "content": "more"}]
            kinds.append("text")
    assert "tool" in kinds and "text" in kinds, kinds
    # Streamed turns were matched back to the stored ones: one branch of six turns.
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["turns"] == 6 and state["branches"] == 1
