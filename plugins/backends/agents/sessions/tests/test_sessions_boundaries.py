"""A family whose render lets the reply continue a system message's text (no assistant marker
after it, as DeepSeek V4's encoder writes it): the reply's first token merges with the system
text's last in the whole render (``'.G', 'ot'``) while the engine generated ``'.', 'Got'``. The
session stores the turn as generated and counts it (``merged_boundaries``, ``non_canonical_turns``
in the summary and the sample's metadata), driven by the official ``openai`` client against a
real session server over a real embedded engine process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

#: ChatML where a system message does not close itself and no assistant marker follows it: an
#: assistant turn after it continues its text. A user turn is always followed by the assistant
#: marker (the generation prompt), as in DeepSeek V4's format. Append-only in text.
JOINED = r"""{%- for m in messages %}
    {%- if m.role == 'system' %}{{- '<|im_start|>system\n' + m.content }}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\n' + m.content + '<|im_end|>\n<|im_start|>assistant\n' }}
    {%- elif m.role == 'assistant' %}{{- m.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}"""

#: Qwen ids: "\n" ends the assistant marker, "." ends the system text.
NL, HELLO, DOT, GOT, IM_END = 198, 9707, 13, 32462, 151645
#: After the assistant marker the model writes "Hello"; after a "." it writes "Got".
SCRIPT = {NL: [HELLO], HELLO: [IM_END], DOT: [GOT], GOT: [IM_END]}


def _family() -> Any:
    from miles_modelfamilies.family import TemplateFamily
    from miles_modelfamilies.qwen3 import tokenizer

    return TemplateFamily(
        name="joined",
        template=JOINED,
        tokenizer=tokenizer(),
        stop_tokens=("<|im_end|>",),
        roles=("system", "user", "assistant"),
        description="a system message's text continued by the reply",
    )


@pytest.fixture(scope="module")
def joined() -> Any:
    """The family whose render merges a reply into the system text before it."""
    return _family()


@pytest.fixture(scope="module")
def server_url(
    joined: Any,
    tmp_path_factory: pytest.TempPathFactory,
    script_model: Any,
    sessions_support: Any,
    loop_thread: Any,
) -> Iterator[str]:
    """A session server for ``joined`` over an engine serving the scripted tiny model."""
    from miles_engine_client import EngineClient
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    model = script_model(Path(tmp_path_factory.mktemp("joined")), script=SCRIPT)
    with sessions_support.engine(model, num_threads=1) as engine_url:

        async def start() -> tuple[Any, Any, str]:
            engine = EngineClient(engine_url, timeout_s=120)
            server = SessionServer(joined, engine, SessionServerOptions(max_new_tokens=8))
            return server, engine, await server.start()

        server, engine, url = loop_thread.run(start())
        try:
            yield url
        finally:

            async def stop() -> None:
                await server.stop()
                await engine.close()

            loop_thread.run(stop())


def test_sessions_boundaries_the_cpu_gate_fails_the_joined_family(joined: Any) -> None:
    from miles_core.families import BOUNDARY_SHAPES, run_cpu_gate

    report = run_cpu_gate(joined, BOUNDARY_SHAPES)
    assert not report.passed
    assert {f.check for f in report.failures} == {"tokens"}
    assert "'.G', 'ot'" in report.failures[0].detail


def test_sessions_boundaries_a_merged_turn_is_counted(
    joined: Any, server_url: str, new_session: Any
) -> None:
    sid = new_session(server_url)
    client = openai.OpenAI(base_url=f"{server_url}/sessions/{sid}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi."}]
    first = client.chat.completions.create(model="miles", messages=messages, seed=0)
    assert first.choices[0].message.content == "Hello"
    # a special token sits between the prompt and the reply: nothing merges
    assert first.model_extra["miles"]["canonical"] is True
    state = httpx.get(f"{server_url}/sessions/{sid}").json()
    assert state["merged_boundaries"] == 0 and state["non_canonical_turns"] == 0

    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "system", "content": "Be brief."},
    ]
    second = client.chat.completions.create(model="miles", messages=messages, seed=1)
    assert second.choices[0].message.content == "Got"
    extension = second.model_extra["miles"]
    assert extension["completion_ids"] == [GOT, IM_END]
    # the text is the canonical render of the reply; the tokens at the join are not
    assert extension["canonical"] is False
    state = httpx.get(f"{server_url}/sessions/{sid}").json()
    assert state["merged_boundaries"] == 1 and state["non_canonical_turns"] == 1

    (sample,) = httpx.get(f"{server_url}/sessions/{sid}/samples").json()["samples"]
    assert sample["metadata"]["merged_boundaries"] == [2]
    assert sample["metadata"]["non_canonical_turns"] == [2]
    stored = sample["prompt_ids"] + sample["response_ids"]
    # stored as the engine saw and generated them: '.', 'Got'; the whole render has '.G', 'ot'
    assert stored[-3:] == [DOT, GOT, IM_END]
    whole = joined.tokenize(joined.render([*messages, {"role": "assistant", "content": "Got"}]))
    # (the render ends with the closing "\n" after <|im_end|>)
    assert [joined.decode([t]) for t in whole[-5:]] == [" brief", ".G", "ot", "<|im_end|>", "\n"]
    assert whole[: len(stored) - 3] == stored[: len(stored) - 3]


def test_sessions_boundaries_checks_both_joins_of_a_turn(joined: Any) -> None:
    from miles_sessions.appender import Appender

    appender = Appender(joined)
    assert appender.boundary("<|im_start|>assistant\n", "Got<|im_end|>") == ""
    detail = appender.boundary("<|im_start|>system\nBe brief.", "Got<|im_end|>")
    assert "stored [' brief', '.', 'Got', '<|im_end|>']" in detail
    assert "canonical [' brief', '.G', 'ot', '<|im_end|>']" in detail
    # a join far into long texts is still found (only the characters around it are tokenized)
    assert appender.boundary("x " * 5000 + "one word", "s." + " y" * 5000)
    assert appender.boundary("", "Got") == "" and appender.boundary("Be brief.", "") == ""
    # a turn's two joins: after the previous reply, and before its own reply
    left = appender.joins("one word", "s.<|im_start|>system\nOk", "<|im_end|>")
    assert left.startswith("after the previous reply: ") and "before the reply" not in left
    right = appender.joins("Hi<|im_end|>", "\n<|im_start|>system\nBe brief.", "Got")
    assert right.startswith("before the reply: ") and "'.G', 'ot'" in right
    assert appender.joins("Hi<|im_end|>", "\n<|im_start|>user\nOk", "Got") == ""
