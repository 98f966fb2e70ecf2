"""The HTTP surface: bad input is a 4xx with a clear message and never a 5xx or a crash
(explicit cases and a hypothesis fuzz), and access control (loopback, bearer token)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOKEN = "t0k3n-for-the-session-server-tests"


@pytest.fixture(scope="module")
def fuzz_server(start_server: Any) -> tuple[Any, str]:
    """A server whose generations are capped at 16 tokens (fuzzed temperatures can make the
    scripted model wander until the cap)."""
    return start_server(max_new_tokens=16, max_new_tokens_limit=16, max_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def sid(fuzz_server: tuple[Any, str], new_session: Any) -> str:
    return new_session(fuzz_server[1], "branching")  # type: ignore[no-any-return]


def _post(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(
        url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60
    )


def _assert_clear_4xx(r: httpx.Response, status: int | None = None) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and len(message) > 10
    return str(message)


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{}", 400, "messages"),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [{"role": 3, "content": "x"}]}', 400, "role"),
    (b'{"messages": [{"role": "developer", "content": "x"}]}', 400, "roles"),
    (b'{"messages": [{"role": "user", "content": {"a": 1}}]}', 400, "content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\n"]}', 400, "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temp"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}', 400, "tools"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    (b"\xff\xfe\x00", 400, "JSON"),
]


@pytest.mark.parametrize("body,status,word", BAD)
def test_sessions_bad_requests(
    fuzz_server: tuple[Any, str], sid: str, body: bytes, status: int, word: str
) -> None:
    msg = _assert_clear_4xx(_post(fuzz_server[1], f"/sessions/{sid}/v1/chat/completions", body))
    assert word.lower() in msg.lower(), msg


def test_sessions_bad_sessions_and_sizes(fuzz_server: tuple[Any, str], sid: str) -> None:
    url = fuzz_server[1]
    ok = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    msg = _assert_clear_4xx(_post(url, "/sessions/nope/v1/chat/completions", ok), 404)
    assert "nope" in msg
    _assert_clear_4xx(httpx.get(f"{url}/sessions/nope/samples"), 404)
    _assert_clear_4xx(_post(url, "/sessions", b'{"mode": "tree"}'), 400)
    _assert_clear_4xx(_post(url, "/sessions", b'{"mode": "linear", "x": 1}'), 400)
    assert httpx.get(f"{url}/nowhere").status_code == 404
    # A message far longer than the engine's context: the engine's refusal, as a 400.
    huge = json.dumps({"messages": [{"role": "user", "content": "word " * 20000}]}).encode()
    msg = _assert_clear_4xx(_post(url, f"/sessions/{sid}/v1/chat/completions", huge), 400)
    assert "engine" in msg
    # A body over the size limit.
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    assert _post(url, f"/sessions/{sid}/v1/chat/completions", big).status_code == 413
    # Empty content and a reply-less append are fine / refused clearly.
    r = _post(url, f"/sessions/{sid}/v1/chat/completions", b'{"messages": [{"role": "user"}]}')
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]
    again = json.dumps({"messages": [{"role": "user", "content": ""}, reply]}).encode()
    msg = _assert_clear_4xx(_post(url, f"/sessions/{sid}/v1/chat/completions", again), 400)
    assert "appends no message" in msg
    # The tools of a session are fixed by its first request.
    other = {"type": "function", "function": {"name": "other"}}
    body = json.dumps({"messages": [{"role": "user", "content": "y"}], "tools": [other]})
    msg = _assert_clear_4xx(_post(url, f"/sessions/{sid}/v1/chat/completions", body.encode()))
    assert "tools" in msg


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", ""])
        | json_values
    },
    optional={
        "content": st.text(max_size=200) | json_values,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": st.text(max_size=8)})}
            )
            | json_values,
            max_size=2,
        ),
        "tool_call_id": st.text(max_size=8) | json_values,
        "reasoning_content": st.text(max_size=20) | json_values,
    },
)
request = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | json_values},
    optional={
        "max_tokens": st.integers(-5, 40) | json_values,
        "temperature": st.floats(-1, 200) | json_values,
        "top_p": st.floats(-1, 2) | json_values,
        "top_k": st.integers(-3, 10) | json_values,
        "seed": st.integers(-5, 2**64) | json_values,
        "stream": st.booleans() | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
        "logprobs": st.booleans() | json_values,
    },
)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=request | json_values,
    path=st.sampled_from(["known", "unknown", "create"]),
    raw=st.none() | st.binary(max_size=64),
)
def test_sessions_fuzz_never_5xx(
    fuzz_server: tuple[Any, str], sid: str, body: Any, path: str, raw: bytes | None
) -> None:
    url = fuzz_server[1]
    target = {
        "known": f"/sessions/{sid}/v1/chat/completions",
        "unknown": "/sessions/0000/v1/chat/completions",
        "create": "/sessions",
    }[path]
    content = raw if raw is not None else json.dumps(body).encode()
    r = _post(url, target, content)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_sessions_still_serves_after_fuzz(fuzz_server: tuple[Any, str], new_session: Any) -> None:
    url = fuzz_server[1]
    s = new_session(url)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 1}).encode()
    r = _post(url, f"/sessions/{s}/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# --- access control ------------------------------------------------------------------------


def test_sessions_check_functions() -> None:
    from miles_sessions.auth import authorized, check_bind, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", TOKEN)
    with pytest.raises(ValueError, match="without a token"):
        check_bind("0.0.0.0", None)
    assert authorized(None, None)
    assert authorized(f"Bearer {TOKEN}", TOKEN)
    assert not authorized(None, TOKEN)
    assert not authorized(TOKEN, TOKEN)
    assert not authorized("Bearer wrong", TOKEN)


def test_sessions_refuses_public_bind_without_token(family: Any) -> None:
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    with pytest.raises(ValueError, match="without a token"):
        SessionServer(family, None, SessionServerOptions(host="0.0.0.0"))


def test_sessions_token_required_from_outside(
    start_server: Any, new_session: Any, tools: Any
) -> None:
    """A server listening beyond loopback (every interface) wants its token from every client;
    reached here through loopback, as the tests send traffic to loopback addresses only."""
    import openai

    server, local = start_server(host="0.0.0.0", token=TOKEN, max_new_tokens=32)
    url = f"http://127.0.0.1:{local.rsplit(':', 1)[1]}"
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.post(f"{url}/sessions", json={}, headers=headers)
        assert r.status_code == 401 and "token" in r.json()["error"]["message"]
    assert not server.sessions
    sid = new_session(url, token=TOKEN)
    refused = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key=TOKEN)
    resp = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], tools=tools, seed=0
    )
    assert resp.choices[0].message.model_extra["reasoning_content"] == "ok"
