"""The official Anthropic client drives sessions with tools, whole and streamed, against a real
session server over a real embedded engine process; a session mixing both APIs stores one
append-only token sequence; bad Messages bodies are 4xx naming the field."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOKEN = "t0k3n-for-the-anthropic-route-tests"
SYSTEM = "You look up the weather."


def _tools(openai_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The OpenAI tool schemas as Anthropic tools."""
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in openai_tools
    ]


def _client(url: str, sid: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key=key, max_retries=0)


def _answer(message: Any, turn: int) -> tuple[str, dict[str, Any]]:
    """Check one reply of the scripted model; the next user message (tool results or text)."""
    kinds = [b.type for b in message.content]
    assert kinds[0] == "thinking" and message.content[0].thinking == "ok", kinds
    miles = message.model_extra["miles"]
    assert message.usage.output_tokens == len(miles["completion_ids"]) > 0
    assert miles["tool_call_errors"] == []
    if message.stop_reason == "tool_use":
        assert kinds == ["thinking", "tool_use"], kinds
        call = message.content[1]
        assert call.name == "lookup" and call.input == {"city": 1}
        assert call.id == f"call_{miles['turn']}_0"
        result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
        return "tool", {"role": "user", "content": [result]}
    assert message.stop_reason == "end_turn" and kinds == ["thinking", "text"], kinds
    assert message.content[1].text == "Done."
    return "text", {"role": "user", "content": [{"type": "text", "text": f"And then ({turn})?"}]}


def test_sessions_anthropic_tools_multi_turn(
    session_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    _, url = session_server
    sid = new_session(url)
    client = _client(url, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    kinds = []
    for turn in range(8):
        message = client.messages.create(
            model="miles",
            system=SYSTEM,
            messages=messages,
            tools=_tools(tools),
            max_tokens=64,
            extra_body={"seed": turn},
        )
        assert message.type == "message" and message.role == "assistant"
        kind, reply = _answer(message, turn)
        kinds.append(kind)
        # Back as the client got it: thinking (with its signature), text and tool_use blocks.
        messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]}]
        messages.append(reply)
    assert "tool" in kinds and "text" in kinds, kinds
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["turns"] == 8 and state["branches"] == 1 and state["rollbacks"] == 0
    sample = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"][0]
    assert sample["metadata"]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert sample["metadata"]["malformed_tool_calls"] == 0


def test_sessions_anthropic_stream(
    session_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    _, url = session_server
    sid = new_session(url)
    client = _client(url, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    kinds = []
    for turn in range(6):
        with client.messages.stream(
            model="miles",
            messages=messages,
            tools=_tools(tools),
            max_tokens=64,
            extra_body={"seed": 200 + turn},
        ) as stream:
            events = [e.type for e in stream]
            message = stream.get_final_message()
        blocks = len(message.content)
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert events.count("content_block_start") == events.count("content_block_stop") == blocks
        kind, reply = _answer(message, turn)
        kinds.append(kind)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]}]
        messages.append(reply)
    assert "tool" in kinds and "text" in kinds, kinds
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["turns"] == 6 and state["branches"] == 1 and state["rollbacks"] == 0


def test_sessions_both_apis_one_token_sequence(
    session_server: tuple[Any, str], new_session: Any, tools: Any
) -> None:
    """Turns alternate between chat completions and messages (streamed and not) on one
    session: every turn extends the same stored sequence, and a turn that came through the
    Messages API appended exactly the tokens the OpenAI route appends for the same messages."""
    server, url = session_server
    sid = new_session(url)
    oai = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    ant = _client(url, sid)
    history: list[dict[str, Any]] = [  # the conversation in OpenAI's form
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in city 1?"},
    ]
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    sequences: list[list[int]] = []
    for turn in range(6):
        if turn % 2 == 0:
            resp = oai.chat.completions.create(
                model="m", messages=history, tools=tools, seed=300 + turn, max_tokens=64
            )
            msg = resp.choices[0].message
            blocks = [{"type": "thinking", "thinking": "ok", "signature": ""}]
            blocks += [{"type": "text", "text": msg.content}] if msg.content else []
            blocks += [
                {"type": "tool_use", "id": c.id, "name": c.function.name}
                | {"input": json.loads(c.function.arguments)}
                for c in msg.tool_calls or ()
            ]
            calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
            content = msg.content or ""
        else:
            kwargs: dict[str, Any] = dict(
                model="m", system=SYSTEM, messages=convo, tools=_tools(tools), max_tokens=64
            )
            if turn % 4 == 1:
                message = ant.messages.create(**kwargs, extra_body={"seed": 300 + turn})
            else:
                with ant.messages.stream(**kwargs, extra_body={"seed": 300 + turn}) as stream:
                    message = stream.get_final_message()
            blocks = [b.model_dump() for b in message.content]
            calls = [
                (b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"
            ]
            content = "".join(b.text for b in message.content if b.type == "text")
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
            new = [
                {"role": "tool", "tool_call_id": i, "content": f"sunny {turn}"} for i, *_ in calls
            ]
            user = {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": i, "content": f"sunny {turn}"}
                    for i, *_ in calls
                ],
            }
        else:
            new = [{"role": "user", "content": f"more {turn}"}]
            user = {"role": "user", "content": f"more {turn}"}
        history += [assistant, *new]
        convo += [{"role": "assistant", "content": blocks}, user]
        session = server.sessions[sid]
        sequences.append(session.tip.token_ids())
    for before, after in itertools.pairwise(sequences):
        assert after[: len(before)] == before  # append-only
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["turns"] == 6 and state["branches"] == 1 and state["rollbacks"] == 0
    sample = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"][0]
    assert sample["prompt_ids"] + sample["response_ids"] == sequences[-1]
    # Each Messages turn appended the session's form of what the OpenAI route would send,
    # and the tokens the OpenAI route's append gives for it.
    path = session.tip.path()
    for turn in path[1::2]:
        assert all("role" in m for m in turn.new_messages)
        again = session.appender.append(
            turn.parent.messages, turn.new_messages, session.tools, closing=turn.parent.closing
        )
        assert again.ids == turn.env_ids
    expect = history[: -len(new)]
    stored = sample["metadata"]["messages"]
    assert [(m["role"], m.get("content") or "") for m in stored] == [
        (m["role"], m.get("content") or "") for m in expect
    ]


# --- bad bodies ------------------------------------------------------------------------------

USER = {"role": "user", "content": "x"}
BAD: list[tuple[Any, int, str]] = [
    ({}, 400, "max_tokens"),
    ({"max_tokens": 8}, 400, "messages"),
    ({"max_tokens": 8, "messages": []}, 400, "messages"),
    ({"max_tokens": 8, "messages": ["hi"]}, 400, "messages[0]"),
    ({"max_tokens": 0, "messages": [USER]}, 400, "max_tokens"),
    ({"max_tokens": 10**6, "messages": [USER]}, 400, "max_tokens"),
    ({"max_tokens": 8, "messages": [USER], "stream": "yes"}, 400, "stream"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        400,
        "messages[0].content[0].text",
    ),
    (
        {
            "max_tokens": 8,
            "messages": [USER, {"role": "assistant", "content": [{"type": "bogus"}]}, USER],
        },
        400,
        "messages[1].content[0].type",
    ),
    (
        {
            "max_tokens": 8,
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "{}"}],
                },
                USER,
            ],
        },
        400,
        "messages[1].content[0].input",
    ),
    (
        {
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}
                    ],
                }
            ],
        },
        400,
        "messages[0].content[0].content[0].type",
    ),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        400,
        "messages[0].content[0].tool_use_id",
    ),
    (
        {"max_tokens": 8, "messages": [USER, {"role": "assistant", "content": "p"}]},
        400,
        "messages[1].role",
    ),
    ({"max_tokens": 8, "messages": [USER], "system": [{"type": "image"}]}, 400, "system[0].type"),
    ({"max_tokens": 8, "messages": [USER], "tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    (
        {"max_tokens": 8, "messages": [USER], "tools": [{"name": "", "input_schema": {}}]},
        400,
        "tools[0].name",
    ),
    (
        {
            "max_tokens": 8,
            "messages": [USER],
            "tools": [{"type": "web_search_20250305", "name": "w"}],
        },
        400,
        "tools[0].type",
    ),
    (
        {"max_tokens": 8, "messages": [USER], "tool_choice": {"type": "any"}},
        400,
        "tool_choice.type",
    ),
    ({"max_tokens": 8, "messages": [USER], "stop_sequences": ["\n"]}, 400, "stop_sequences"),
    ({"max_tokens": 8, "messages": [USER], "temperature": "hot"}, 400, "temperature"),
]


@pytest.fixture(scope="module")
def small_server(start_server: Any) -> tuple[Any, str]:
    """A server with a 64 KiB body limit, 4096 characters of text and 16-token turns."""
    return start_server(  # type: ignore[no-any-return]
        max_new_tokens=16, max_new_tokens_limit=16, max_body_bytes=1 << 16, max_text_chars=4096
    )


def _post(url: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url, content=content, headers={"Content-Type": "application/json"}, timeout=60
    )


def _anthropic_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"], body
    return str(body["error"]["message"])


@pytest.mark.parametrize("body,status,field", BAD)
def test_sessions_anthropic_bad_bodies(
    small_server: tuple[Any, str], new_session: Any, body: Any, status: int, field: str
) -> None:
    url = small_server[1]
    sid = new_session(url)
    message = _anthropic_error(_post(f"{url}/sessions/{sid}/v1/messages", body), status)
    assert field in message, message


def test_sessions_anthropic_limits_and_errors(
    small_server: tuple[Any, str], new_session: Any
) -> None:
    url = small_server[1]
    sid = new_session(url)
    route = f"{url}/sessions/{sid}/v1/messages"
    big = {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * (1 << 17)}]}
    assert "limited to" in _anthropic_error(_post(route, big), 413)
    wide = {"max_tokens": 8, "messages": [USER], "system": "y" * 5000}
    assert "max_text_chars" in _anthropic_error(_post(route, wide), 413)
    msg = _anthropic_error(_post(f"{url}/sessions/nope/v1/messages", {}), 404)
    assert "nope" in msg
    assert "JSON" in _anthropic_error(_post(route, b"{nope"), 400)
    # The official client surfaces the message that names the field.
    client = _client(url, sid)
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],  # type: ignore[list-item,typeddict-item]
        )
    # Nothing was stored by the refusals; a good request still works.
    ok = client.messages.create(model="m", max_tokens=8, messages=[USER], extra_body={"seed": 1})
    assert ok.content[0].type == "thinking"
    assert httpx.get(f"{url}/sessions/{sid}").json()["turns"] == 1


block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", 3])},
    optional={
        "text": st.text(max_size=10) | st.integers(),
        "id": st.text(max_size=4) | st.none(),
        "name": st.text(max_size=4) | st.integers(),
        "input": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
        | st.text(max_size=3),
        "tool_use_id": st.text(max_size=4) | st.integers(),
        "content": st.text(max_size=4)
        | st.lists(
            st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), max_size=2
        ),
        "thinking": st.text(max_size=4) | st.none(),
    },
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", 1]),
        "content": st.text(max_size=20) | st.lists(block, max_size=3) | st.integers(),
    }
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    messages=st.lists(anthropic_message, max_size=4),
    extra=st.dictionaries(
        st.sampled_from(["system", "tools", "tool_choice", "max_tokens", "stream", "top_k"]),
        st.none()
        | st.integers(-2, 20)
        | st.text(max_size=5)
        | st.lists(st.integers(), max_size=2)
        | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    ),
)
def test_sessions_anthropic_fuzz_never_5xx(
    small_server: tuple[Any, str], new_session: Any, messages: Any, extra: Any
) -> None:
    url = small_server[1]
    sid = new_session(url, "branching")
    body = {"max_tokens": 8, "messages": messages, **extra}
    r = _post(f"{url}/sessions/{sid}/v1/messages", body)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_sessions_anthropic_key_header(start_server: Any, new_session: Any) -> None:
    """A server with a token takes it from Anthropic's ``x-api-key`` header as well as from
    ``Authorization: Bearer``."""
    _, local = start_server(token=TOKEN, max_new_tokens=16)
    sid = new_session(local, token=TOKEN)
    with pytest.raises(anthropic.AuthenticationError):
        _client(local, sid, "wrong").messages.create(model="m", max_tokens=8, messages=[USER])
    reply = _client(local, sid, TOKEN).messages.create(model="m", max_tokens=8, messages=[USER])
    assert reply.content[0].type == "thinking"
    # The same token as a bearer, the OpenAI route's way.
    bearer = anthropic.Anthropic(base_url=f"{local}/sessions/{sid}", auth_token=TOKEN)
    history = [USER, {"role": "assistant", "content": [b.model_dump() for b in reply.content]}]
    again = bearer.messages.create(model="m", max_tokens=8, messages=[*history, USER])
    assert again.model_extra["miles"]["turn"] == 2
