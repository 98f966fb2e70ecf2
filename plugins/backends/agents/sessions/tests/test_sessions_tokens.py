"""Stored training tokens are exactly what the engine generated plus the canonical render of
what each request appended; linear retry rolls back, branching keeps every continuation."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

IM_END, NL = 151645, 198


def _engine_generate(loop_thread: Any, engine_url: str, ids: list[int], params: dict) -> Any:
    from miles_engine_client import EngineClient

    async def go() -> Any:
        async with EngineClient(engine_url, timeout_s=60) as c:
            return await c.generate(ids, params, return_logprob=True)

    return loop_thread.run(go())


def test_sessions_twenty_turns_token_for_token(
    session_server: tuple[Any, str],
    family: Any,
    engine_url: str,
    loop_thread: Any,
    new_session: Any,
    tools: Any,
) -> None:
    _, url = session_server
    sid = new_session(url)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You look up the weather."},
        {"role": "user", "content": "Weather in city 1? ünïcödé 天气"},
    ]
    expected: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    rendered_so_far = ""
    stops = list(family.stop_token_ids)
    tool_turns = 0
    for turn in range(20):
        whole = family.render(messages, tools=tools, add_generation_prompt=True)
        assert whole.startswith(rendered_so_far)
        # The engine stopped on <|im_end|>; the template writes "\n" after it, before the
        # next message: that separator is rendered (untrained) with the appended messages.
        appended = ("\n" if turn else "") + whole[len(rendered_so_far) :]
        env = family.tokenize(appended)
        expected += env
        mask += [0] * len(env)
        logprobs += [0.0] * len(env)
        params = {"max_new_tokens": 64, "temperature": 1.0, "stop_token_ids": stops}
        params["sampling_seed"] = 1000 + turn
        direct = _engine_generate(loop_thread, engine_url, expected, params)
        resp = client.chat.completions.create(
            model="m", messages=messages, tools=tools, seed=1000 + turn, max_tokens=64
        )
        assert resp.model_extra["miles"]["completion_ids"] == direct.output_ids
        assert resp.usage.prompt_tokens == len(expected)
        expected += direct.output_ids
        mask += [1] * len(direct.output_ids)
        logprobs += direct.logprobs
        msg = resp.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        rendered_so_far = family.render(messages, tools=tools)
        if msg.get("tool_calls"):
            tool_turns += 1
            call = msg["tool_calls"][0]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{turn} C"})
        else:
            messages.append({"role": "user", "content": f"and in {turn} days?"})
    assert 3 <= tool_turns <= 17
    samples = httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"]
    assert len(samples) == 1
    s = samples[0]
    first_prompt = len(s["prompt_ids"])
    assert s["prompt_ids"] + s["response_ids"] == expected
    assert s["loss_mask"] == mask[first_prompt:]
    assert s["logprobs"] == pytest.approx(logprobs[first_prompt:], abs=1e-5)
    assert set(s["versions"]) == {-1, 0}
    assert [v for v, m in zip(s["versions"], s["loss_mask"], strict=True) if m] == [0] * sum(
        s["loss_mask"]
    )
    assert len(s["metadata"]["turns"]) == 20


def _chat(url: str, sid: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 64, **kw}
    r = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _samples(url: str, sid: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/sessions/{sid}/samples").json()["samples"]  # type: ignore[no-any-return]


def test_sessions_linear_retry_rolls_back(
    session_server: tuple[Any, str], new_session: Any
) -> None:
    _, url = session_server
    sid = new_session(url, "linear")
    m1 = [{"role": "user", "content": "hi"}]
    a1 = _chat(url, sid, m1, seed=1)["choices"][0]["message"]
    m2 = [*m1, a1, {"role": "user", "content": "again"}]
    _chat(url, sid, m2, seed=2)
    before = _samples(url, sid)[0]
    # Retry the last turn (same request, another seed): it replaces the stored one.
    a2b = _chat(url, sid, m2, seed=3)
    after = _samples(url, sid)
    assert len(after) == 1 and len(after[0]["metadata"]["turns"]) == 2
    state = httpx.get(f"{url}/sessions/{sid}").json()
    assert state["rollbacks"] == 1 and state["turns"] == 2
    # Same tokens up to the retried turn's generation, its own tokens after.
    shared = len(after[0]["response_ids"]) - len(a2b["miles"]["completion_ids"])
    assert after[0]["response_ids"][:shared] == before["response_ids"][:shared]
    assert after[0]["response_ids"][shared:] == a2b["miles"]["completion_ids"]
    # Diverging earlier than the last turn is refused in a linear session.
    m3 = [{"role": "user", "content": "something else"}, a1, {"role": "user", "content": "x"}]
    r = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json={"messages": m3})
    assert r.status_code == 409 and "branching" in r.json()["error"]["message"]


def test_sessions_branching_two_continuations(
    session_server: tuple[Any, str], new_session: Any
) -> None:
    _, url = session_server
    sid = new_session(url, "branching")
    m1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    a1 = _chat(url, sid, m1, seed=5)["choices"][0]["message"]
    left = [*m1, a1, {"role": "user", "content": "left"}]
    right = [*m1, a1, {"role": "user", "content": "right"}]
    al = _chat(url, sid, left, seed=6)["choices"][0]["message"]
    _chat(url, sid, right, seed=7)
    # Extending one branch keeps two leaves.
    _chat(url, sid, [*left, al, {"role": "user", "content": "deeper"}], seed=8)
    samples = _samples(url, sid)
    assert len(samples) == 2
    a, b = samples
    assert a["prompt_ids"] == b["prompt_ids"]
    # Both share the first turn's tokens (prompt and generation) and the separator after it.
    first_env = next(i for i, m in enumerate(a["loss_mask"]) if m == 0)
    assert a["response_ids"][: first_env + 1] == b["response_ids"][: first_env + 1]
    assert a["response_ids"] != b["response_ids"]
    assert sorted(len(s["metadata"]["turns"]) for s in samples) == [2, 3]
    for s in samples:
        assert len(s["response_ids"]) == len(s["loss_mask"]) == len(s["logprobs"])


def test_sessions_length_cut_is_closed(
    session_server: tuple[Any, str], family: Any, new_session: Any
) -> None:
    _, url = session_server
    sid = new_session(url)
    m1 = [{"role": "user", "content": "hi"}]
    r1 = _chat(url, sid, m1, max_tokens=2, seed=0)
    assert r1["choices"][0]["finish_reason"] == "length"
    cut = r1["miles"]["completion_ids"]
    assert len(cut) == 2
    m2 = [*m1, r1["choices"][0]["message"], {"role": "user", "content": "go on"}]
    _chat(url, sid, m2, seed=1)
    s = _samples(url, sid)[0]
    # The cut turn is closed by the template's end of turn, untrained.
    assert s["response_ids"][:4] == [*cut, IM_END, NL]
    assert s["loss_mask"][:4] == [1, 1, 0, 0]
    assert family.decode(s["response_ids"][4:7]) == "<|im_start|>user\n"
