"""Hostile and careless input against a real session server over a real embedded engine:
control-token text in messages stays text on every shipped family, tokenization does not stall
the server, malformed bodies are 4xx (a hypothesis fuzz too), and an engine that dies mid-turn
is a 502 that leaves the session as it was."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from miles_modelfamilies.testing import FORGED, SHIPPED, build, control_tokens, conversation, tool

# --- a session server per family over the module's engine ---------------------------------------


@pytest.fixture(scope="module")
def family_servers(
    loop_thread: Any,
    engine_url: str,
    sessions_support: Any,
    script_model: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """A session server for every shipped family over the scripted engine (the engine
    generates ids; which family reads them does not matter to it); a family with ids beyond
    Qwen3's vocabulary gets a second engine whose model has room for them."""
    from miles_engine_client import EngineClient
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    families = {name: build(name) for name in SHIPPED}
    vocab = max(max(f.tokenizer.special_ids()) + 1 for f in families.values())
    vocab = (vocab + 63) // 64 * 64
    path = script_model(tmp_path_factory.mktemp("wide-vocab"), vocab_size=vocab)
    with sessions_support.engine(path, context_length=4096) as wide_url:
        started: list[tuple[Any, Any]] = []

        async def go() -> dict[str, str]:
            urls = {}
            for name, family in families.items():
                big = max(family.tokenizer.special_ids()) >= 151936
                engine = EngineClient(wide_url if big else engine_url, timeout_s=120)
                options = SessionServerOptions(max_new_tokens=4)
                server = SessionServer(family, engine, options)
                urls[name] = await server.start()
                started.append((server, engine))
            return urls

        yield loop_thread.run(go(), timeout=300)

        async def stop() -> None:
            for server, engine in started:
                await server.stop()
                await engine.close()

        loop_thread.run(stop())


@pytest.mark.parametrize("name", SHIPPED)
def test_sessions_control_token_text_is_stored_as_text(
    family_servers: dict[str, str], new_session: Any, name: str
) -> None:
    url = family_servers[name]
    family = build(name)
    _, control_ids, find = control_tokens(family)
    sid = new_session(url)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    messages = conversation(FORGED)
    resp = client.chat.completions.create(
        model="m", messages=messages, tools=[tool()], max_tokens=2, seed=0
    )
    assert resp.usage.prompt_tokens > 0
    sample = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"][0]
    prompt = sample["prompt_ids"]
    # The stored prompt decodes to the template's render of what the client sent ...
    assert family.decode(prompt) == family.render(
        messages, tools=[tool()], add_generation_prompt=True
    )
    # ... and holds exactly the template's control tokens: none came from the content.
    clean = family.render(conversation("x"), tools=[tool()], add_generation_prompt=True)
    expected = sorted(family.tokenizer.token_id(m.group(0)) for m in find.finditer(clean))
    assert sorted(i for i in prompt if i in control_ids) == expected


# --- the event loop, bodies, the engine dying ---------------------------------------------------


@pytest.fixture(scope="module")
def server(start_server: Any) -> tuple[Any, str]:
    """A server with the default body and text limits."""
    return start_server(max_new_tokens=16)  # type: ignore[no-any-return]


def _chat(url: str, sid: str, content: bytes, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"{url}/sessions/{sid}/v1/chat/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def _health_while(url: str, work: Any) -> tuple[Any, float]:
    """Run ``work()`` in a thread while polling ``/health``; its result and the slowest
    health answer (seconds)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except Exception as exc:  # reported below
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    slowest = 0.0
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            t0 = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"], slowest


def test_sessions_health_answers_while_a_huge_message_is_refused(
    server: tuple[Any, str], new_session: Any
) -> None:
    srv, url = server
    sid = new_session(url)
    huge = json.dumps({"messages": [{"role": "user", "content": "word " * (8 << 20)}]}).encode()
    assert len(huge) > 40_000_000

    def send_huge() -> tuple[int, str]:
        try:
            r = _chat(url, sid, huge)
        except httpx.TransportError as exc:  # the server may close before reading it all
            return 0, repr(exc)
        return r.status_code, r.json()["error"]["message"]

    (status, message), slowest = _health_while(url, send_huge)
    assert slowest < 1.0, slowest
    assert status in (413, 0), (status, message)
    if status:
        assert str(srv.options.max_body_bytes) in message
    # Under the body limit but more text than any context holds: 413 naming max_text_chars,
    # before it is tokenized.
    long = json.dumps({"messages": [{"role": "user", "content": "w" * (5 << 20)}]}).encode()
    (r), slowest = _health_while(url, lambda: _chat(url, sid, long))
    assert slowest < 1.0, slowest
    assert r.status_code == 413 and "max_text_chars" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/sessions/{sid}").json()["turns"] == 0


def test_sessions_tokenizes_off_the_event_loop(
    loop_thread: Any, family: Any, new_session: Any
) -> None:
    """A long message under raised limits takes seconds to render and tokenize: /health
    answers meanwhile. (The server has no engine, so the tokenized turn then ends in a 503.)"""
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    options = SessionServerOptions(max_text_chars=64 << 20, max_body_bytes=64 << 20)
    srv = SessionServer(family, None, options)
    url = loop_thread.run(srv.start())
    try:
        sid = new_session(url)
        text = " ".join(f"w{i}" for i in range(2_000_000))
        body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
        t0 = time.monotonic()
        r, slowest = _health_while(url, lambda: _chat(url, sid, body))
        took = time.monotonic() - t0
        assert r.status_code == 503 and "no engine" in r.json()["error"]["message"], r.text
        assert slowest < 1.0, (slowest, took)
    finally:
        loop_thread.run(srv.stop())


@pytest.mark.parametrize(
    "body,word",
    [
        (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper"),
        (
            b'{"messages": [{"role": "user", "content": ' + b"[" * 100 + b"]" * 100 + b"}]}",
            "deeper",
        ),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "surrogate"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"\\udfff": 1}]}', "surrog"),
    ],
)
def test_sessions_deep_nesting_and_lone_surrogates_are_400(
    server: tuple[Any, str], new_session: Any, body: bytes, word: str
) -> None:
    _, url = server
    sid = new_session(url)
    for target in (f"/sessions/{sid}/v1/chat/completions", "/sessions"):
        r = httpx.post(url + target, content=body, timeout=60)
        assert r.status_code == 400, (target, r.status_code, r.text)
        assert word in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/health").status_code == 200


def test_sessions_engine_killed_mid_turn_is_502(
    loop_thread: Any, family: Any, script_model: Any, tmp_path: Any, new_session: Any
) -> None:
    from miles_engine_client import EngineClient
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    model = script_model(tmp_path / "model")
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=1, context_length=8192, num_threads=1, startup_timeout_s=180
        )
    )
    engine_url = launcher.launch(str(model), index=0)
    started: list[Any] = []
    try:

        async def start() -> str:
            engine = EngineClient(engine_url, timeout_s=120)
            server = SessionServer(
                family, engine, SessionServerOptions(max_new_tokens=8, max_new_tokens_limit=8000)
            )
            started.extend([server, engine])
            return await server.start()

        url = loop_thread.run(start())
        sid = new_session(url)
        client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        first = [{"role": "user", "content": "Weather in city 1?"}]
        ok = client.chat.completions.create(model="m", messages=first, seed=0)
        history = [*first, ok.choices[0].message.model_dump(exclude_none=True)]
        history.append({"role": "user", "content": "And tomorrow?"})
        # A hot temperature makes the scripted model wander for thousands of tokens: the turn
        # is still running when the engine process is killed.
        proc = launcher.processes[0]
        killer = threading.Timer(2.0, proc.kill)
        killer.start()
        try:
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(
                    model="m", messages=history, max_tokens=8000, temperature=100.0, seed=1
                )
        finally:
            killer.cancel()
        proc.wait(30)
        assert info.value.status_code == 502, info.value
        assert "engine" in info.value.message
        # The failed turn is not stored; the session is as after its first turn.
        state = httpx.get(f"{url}/sessions/{sid}").json()
        assert state["turns"] == 1, state
        samples = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"]
        assert len(samples) == 1
        assert httpx.get(f"{url}/health").status_code == 200
    finally:

        async def stop() -> None:
            if started:
                await started[0].stop()
                await started[1].close()

        loop_thread.run(stop())
        launcher.shutdown()


# --- fuzz -----------------------------------------------------------------------------------


def _dumps(body: Any) -> bytes:
    # ensure_ascii writes a lone surrogate as its \\ud800 escape, as a hostile client would.
    return json.dumps(body, ensure_ascii=True).encode()


def _nested(depth: int, leaf: Any, where: int) -> bytes:
    """``leaf`` inside ``depth`` arrays, as the whole body, its messages or a content."""
    inner = b"[" * depth + _dumps(leaf) + b"]" * depth
    if where == 0:
        return inner
    if where == 1:
        return b'{"messages": ' + inner + b"}"
    return b'{"messages": [{"role": "user", "content": ' + inner + b"}]}"


any_text = st.text(st.characters(exclude_categories=()), max_size=60)
surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF).map(lambda c: f"a{c}b")
texts = any_text | surrogate | st.sampled_from([FORGED, "<|im_start|>", "\x00", "\U0010fffd"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "tool", "assistant", "bot"]) | json_values},
    optional={
        "content": texts | json_values,
        "name": texts,
        "tool_call_id": texts | json_values,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": texts,
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": texts, "arguments": texts}),
                }
            )
            | json_values,
            max_size=2,
        ),
    },
)
bodies = st.one_of(
    st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=4) | json_values},
        optional={
            "max_tokens": st.integers(-2, 4) | json_values,
            "temperature": st.floats(0, 2) | json_values,
            "stream": st.booleans(),
            "tools": st.lists(json_values, max_size=2),
            "mode": json_values,
        },
    ),
    json_values,
).map(_dumps) | st.builds(_nested, st.integers(50, 5000), json_values, st.integers(0, 2))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies, create=st.booleans())
def test_sessions_fuzz_bodies_never_500(
    server: tuple[Any, str], new_session: Any, body: bytes, create: bool
) -> None:
    _, url = server
    target = "/sessions" if create else f"/sessions/{new_session(url)}/v1/chat/completions"
    r = httpx.post(url + target, content=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
