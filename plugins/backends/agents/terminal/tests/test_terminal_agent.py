"""The shell agent over real HTTP: a scripted chat server stands in for the model (it answers
with fixed tool calls), the agent runs them in a real sandbox, and the ``terminal_tests``
reward grades the transcript by replaying its shell calls in a fresh sandbox."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from miles_env_terminal.agent import terminal_agent
from miles_env_terminal.plugin import (
    TerminalTasks,
    TerminalTasksOptions,
    TerminalTests,
    TerminalTestsOptions,
)
from miles_env_terminal.sandbox import SandboxLimits

from miles_core.data import Sample

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import assert_nothing_left, sandbox_or_skip

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

LIMITS = SandboxLimits(wall_s=4, cpu_s=1, memory_mb=256, max_processes=16)


def _call(i: int, command: str) -> dict[str, Any]:
    args = json.dumps({"command": command})
    return {"id": f"call_{i}", "type": "function", "function": {"name": "shell", "arguments": args}}


async def _run(script: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Serve a chat API that issues ``script``'s commands one per turn, then a final answer;
    run the agent against it; return the transcript and the prompt record."""
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        assert request.headers["Authorization"] == "Bearer secret"
        assert body["tools"][0]["function"]["name"] == "shell"
        seen.append(body)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn < len(script):
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call(turn, script[turn])],
            }
        else:
            message = {"role": "assistant", "content": "done"}
        return web.json_response({"choices": [{"message": message}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    record = next(iter(TerminalTasks(TerminalTasksOptions(tasks=["reverse"]))))
    try:
        await terminal_agent(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="secret",
            prompt=record,
            seed=0,
            max_turns=len(script) + 1,
            limits=LIMITS,
        )
    finally:
        await runner.cleanup()
    transcript = [*seen[-1]["messages"], {"role": "assistant", "content": "done"}]
    return transcript, record


@pytest.fixture(autouse=True)
def _isolation() -> Any:
    sandbox_or_skip(LIMITS).close()
    yield
    assert_nothing_left()


def test_agent_solves_a_task_and_the_reward_replays_it() -> None:
    script = [
        "printf 'def reverse_string(s):\\n    return s[::-1]\\n' > solution.py",
        "python3 -c 'from solution import reverse_string as r; print(r(\"abc\"))'",
    ]
    transcript, record = asyncio.run(_run(script))
    tools = [m for m in transcript if m["role"] == "tool"]
    assert [t["tool_call_id"] for t in tools] == ["call_0", "call_1"]
    assert tools[1]["content"] == "exit code: 0\nstdout:\ncba"
    sample = Sample(prompt_ids=[1], metadata={"messages": transcript, "response_text": "done"})
    reward = TerminalTests(TerminalTestsOptions(limits=LIMITS))
    assert reward(sample, record) == 1.0
    assert sample.metadata["terminal"]["passed"] == sample.metadata["terminal"]["total"]


def test_a_violation_in_the_transcript_grades_zero() -> None:
    script = [
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 443))\"",
        "printf 'def reverse_string(s):\\n    return s[::-1]\\n' > solution.py",
    ]
    transcript, record = asyncio.run(_run(script))
    tools = [m for m in transcript if m["role"] == "tool"]
    assert "[stopped by the sandbox: network]" in tools[0]["content"]
    sample = Sample(prompt_ids=[1], metadata={"messages": transcript})
    assert TerminalTests(TerminalTestsOptions(limits=LIMITS))(sample, record) == 0.0
    assert "network" in sample.metadata["terminal"]["violations"]
