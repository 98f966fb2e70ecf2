"""The calculator environment: the safe evaluator, the task files (valid for the
``conversations`` and ``jsonl`` sources and the ``last_number`` reward), the agent over real
HTTP with the official ``openai`` client against a scripted chat server, and the job's report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from miles_env_calculator.agent import calculator_agent, tool_result
from miles_env_calculator.calc import CalcError, calculate, format_number
from miles_env_calculator.report import summarize, token_checks
from miles_env_calculator.tasks import write

from miles_core.builtins.conversations import conversation_problem
from miles_core.builtins.rewards import LastNumber, LastNumberOptions
from miles_core.data import Sample

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("openai")
from aiohttp import web  # noqa: E402


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12 * 34", 408), ("478 + 41 * 86", 4004), ("(2 + 3) * -4", -20), ("7 / 2", 3.5)],
)
def test_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("9 ** 9 ** 9", "Pow"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 / 0", "division by zero"),
        ("99999999 * 99999999 * 99999999", "above"),
        ("(" * 30 + "1" + ")" * 30 + "+" + "1+" * 30 + "1", "nests deeper"),
        ("1 + " * 60 + "1", "longer than"),
        ("1 +", "not an arithmetic expression"),
        ("[1, 2]", "List"),
    ],
)
def test_refused(expression: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        calculate(expression)


def test_format_and_tool_results() -> None:
    assert format_number(408.0) == "408" and format_number(3.5) == "3.5"
    call = {"function": {"name": "calculate", "arguments": '{"expression": "6 * 7"}'}}
    assert tool_result(call) == "42"
    assert tool_result({"function": {"name": "shell", "arguments": "{}"}}).startswith("error")
    bad = {"function": {"name": "calculate", "arguments": '{"expression": "open(1)"}'}}
    assert "Call is not allowed" in tool_result(bad)
    assert "not JSON" in tool_result({"function": {"name": "calculate", "arguments": "{"}})


def test_task_files(tmp_path: Path) -> None:
    assert write(tmp_path, 20, 10, 5) == {"train.jsonl": 20, "heldout.jsonl": 10, "sft.jsonl": 5}
    rows = {
        n: [json.loads(x) for x in (tmp_path / n).read_text().splitlines()]
        for n in ("train.jsonl", "heldout.jsonl", "sft.jsonl")
    }
    for row in rows["sft.jsonl"]:
        assert conversation_problem(row) is None
        assert row["messages"][2]["content"] == row["messages"][3]["content"][14:-1]
    train_ids = {r["task_id"] for r in rows["train.jsonl"]}
    held = rows["heldout.jsonl"]
    assert all(r["temperature"] == 0.0 for r in held) and not train_ids & {
        r["task_id"] for r in held
    }
    assert {r["prompt"] for r in held} != {r["prompt"] for r in rows["train.jsonl"][:10]}
    for row in rows["train.jsonl"]:
        assert format_number(calculate(row["expression"])) == row["answer"]


async def _episode(record: dict[str, Any], replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the agent against a chat server that answers with ``replies`` in turn; the bodies
    the server received."""
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer secret"
        body = await request.json()
        seen.append(body)
        message = replies[len(seen) - 1]
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await calculator_agent(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="secret",
            prompt=record,
            seed=5,
            max_turns=3,
        )
    finally:
        await runner.cleanup()
    return seen


def test_agent_runs_the_tool_and_the_answer_is_graded() -> None:
    record = {"prompt": "What is 37 * 48?", "answer": "1776", "temperature": 0.0}
    args = json.dumps({"expression": "37 * 48"})
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculate", "arguments": args},
    }
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "The answer is 1776."},
    ]
    seen = asyncio.run(_episode(record, replies))
    assert len(seen) == 2
    assert seen[0]["tools"][0]["function"]["name"] == "calculate"
    assert seen[0]["temperature"] == 0.0 and [b["seed"] for b in seen] == [5, 6]
    tool = seen[1]["messages"][-1]
    assert tool == {"role": "tool", "tool_call_id": "call_0", "content": "1776"}
    reward = LastNumber(LastNumberOptions())
    sample = Sample(prompt_ids=[1], metadata={"response_text": replies[-1]["content"]})
    assert reward(sample, record) == 1.0


def test_agent_stops_after_max_turns() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "calculate", "arguments": "{}"}}
    replies = [{"role": "assistant", "content": "", "tool_calls": [call]}] * 3
    seen = asyncio.run(_episode({"prompt": "What is 2 * 3?", "answer": "6"}, replies))
    assert len(seen) == 3 and "temperature" not in seen[0]
    assert "needs an 'expression'" in seen[2]["messages"][-1]["content"]


def test_report(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.2},
        {
            "step": 1,
            "train/mismatch/abs_mean": 0.01,
            "counts/non_canonical_turns": 1.0,
            "counts/tito_turns": 9.0,
            "counts/tito_mismatches": 0.0,
        },
        {"step": 2, "train/mismatch/abs_mean": 0.2, "counts/tito_turns": 7.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rl = {"accuracy_before": 0.2, "accuracy_after": 0.5, "n_heldout": 100, "run_dir": str(tmp_path)}
    out = summarize({"run_dir": "sft"}, rl, 12.0)
    assert out["improved_by_2_stderr"] and out["improvement_in_stderr"] > 4
    assert out["tito_ok"] and out["tito_turns"] == 16 and out["non_canonical_turns"] == 1
    assert out["mismatch_abs_mean_max"] == 0.2
    rows.append({"step": 3, "counts/tito_turns": 4.0, "counts/tito_mismatches": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not token_checks(tmp_path / "metrics.jsonl")["tito_ok"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert not token_checks(tmp_path / "metrics.jsonl")["tito_ok"]  # nothing checked
    small = summarize({}, dict(rl, accuracy_after=0.25), 1.0)
    assert not small["improved_by_2_stderr"]
