"""What a session's turns are drawn with: the ``session`` rollout passes the run's
``temperature``, ``top_p`` and ``top_k`` to the engine where the agent's requests give none, a
request's own values win, and every sample records what its turns were drawn with (the trainer
truncates its log-probs the same way)."""

from __future__ import annotations

from typing import Any

import openai


class _Recording:
    """An engine client that keeps the sampling parameters of every generation."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.drawn: list[dict[str, Any]] = []

    async def generate(self, input_ids: Any, sampling_params: Any, **kwargs: Any) -> Any:
        self.drawn.append(dict(sampling_params))
        return await self.engine.generate(input_ids, sampling_params, **kwargs)


def _turns(url: str, sid: str, tools: Any, params: list[dict[str, Any]]) -> None:
    """One chat turn per entry of ``params`` (its sampling fields) through the official
    ``openai`` client; tool calls answered, a plain reply followed by a user message."""
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    for extra in params:
        resp = client.chat.completions.create(
            model="miles", messages=messages, tools=tools, max_tokens=64, **extra
        )
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        if not msg.tool_calls:
            messages.append({"role": "user", "content": "And tomorrow?"})


def test_session_rollout_draws_with_the_runs_sampling_params(
    family: Any, engine_url: str, loop_thread: Any, tools: Any
) -> None:
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions, build

    rollout = build(SessionRolloutOptions(max_turns=3, max_new_tokens=32))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
    }
    run = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64}

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        async with EngineClient(engine_url, timeout_s=60) as client:
            engine = _Recording(client)
            try:
                group = await rollout(
                    prompt,
                    group_size=2,
                    engine=engine,
                    reward=lambda sample, prompt: 1.0,
                    family=family,
                    sampling_params=run,
                    step=1,
                )
            finally:
                await rollout.close()
            return group, engine.drawn

    group, drawn = loop_thread.run(go())
    assert drawn and all(
        (d["temperature"], d["top_p"], d["top_k"]) == (0.7, 0.9, 20) for d in drawn
    ), drawn
    # the rollout's own per-turn cap, not the run's single-turn one
    assert all(d["max_new_tokens"] == 32 for d in drawn), drawn
    for sample in group.samples:
        assert not sample.failed, sample.metadata
        assert sample.sampling_params == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
        # every stored turn is one of the engine's generations, token for token
        turns = len(sample.metadata["turns"])
        assert sample.counts["tito_turns"] == turns >= 1
        assert sample.counts["tito_mismatches"] == 0


def test_session_request_values_win_and_mixed_truncations_fail_the_sample(
    session_server: tuple[Any, str], loop_thread: Any, tools: Any
) -> None:
    server, url = session_server
    session = server.new_session(sampling={"temperature": 0.0, "top_k": 20, "ignored": 1})
    assert session.sampling == {"temperature": 0.0, "top_k": 20}
    _turns(url, session.id, tools, [{"top_p": 0.5}, {"top_p": 0.9}])
    turns = session.leaves()[0].path()
    assert [t.sampling for t in turns] == [
        {"temperature": 0.0, "top_p": 0.5, "top_k": 20},
        {"temperature": 0.0, "top_p": 0.9, "top_k": 20},
    ]
    (sample,) = session.samples()
    assert sample.failed and "different truncations" in sample.metadata["error"]
    server.sessions.pop(session.id, None)


def test_session_sample_records_one_shared_draw(
    session_server: tuple[Any, str], tools: Any
) -> None:
    server, url = session_server
    session = server.new_session()
    client = openai.OpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in city 1?"}]
    client.chat.completions.create(
        model="miles",
        messages=messages,
        tools=tools,
        temperature=0.5,
        max_tokens=64,
        extra_body={"top_k": 7},
    )
    (sample,) = session.samples()
    assert not sample.failed
    assert sample.sampling_params == {"temperature": 0.5, "top_k": 7}
    server.sessions.pop(session.id, None)


def test_engine_record_counts_a_stored_turn_that_is_not_the_engines(
    session_server: tuple[Any, str], loop_thread: Any, tools: Any
) -> None:
    """The check fails a session whose stored tokens were changed after generation (what
    decoding and tokenizing again would do), and passes it as generated."""
    from miles_sessions.rollout import EngineRecord

    server, url = session_server
    session = server.new_session()
    record = EngineRecord(server.engine)
    session.engine = record
    _turns(url, session.id, tools, [{}, {}])
    (leaf,) = session.leaves()
    assert record.check(leaf) == {"tito_turns": 2.0, "tito_mismatches": 0.0}
    first = leaf.path()[0]
    first.gen_ids = [*first.gen_ids[:-1], first.gen_ids[-1] + 1]
    # the first turn's reply and the second's context no longer match the engine's
    assert record.check(leaf) == {"tito_turns": 2.0, "tito_mismatches": 2.0}
    server.sessions.pop(session.id, None)
