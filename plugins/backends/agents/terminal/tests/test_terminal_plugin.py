"""Registration through the ``miles`` entry point and the core's contract checks for the data
source and the reward; the reward's three ways of grading an episode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from miles_env_terminal.plugin import (
    TerminalTasks,
    TerminalTasksOptions,
    TerminalTests,
    TerminalTestsOptions,
)
from miles_env_terminal.sandbox import SandboxLimits, SandboxUnavailable
from pydantic import ValidationError

from miles_core import Kind
from miles_core.contracts import PromptSource, RewardFn
from miles_core.data import Sample
from miles_core.plugins import load_plugins
from miles_core.testing.contracts import check_component

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import sandbox_or_skip


@pytest.fixture(scope="module")
def registry():  # type: ignore[no-untyped-def]
    return load_plugins(allow=["terminal"]).registry


def test_registered_and_pass_the_contract_checks(registry) -> None:  # type: ignore[no-untyped-def]
    sandbox_or_skip().close()
    source = check_component(registry.get(Kind.DATA_SOURCE, "terminal_tasks"))
    assert isinstance(source, PromptSource)
    reward = check_component(registry.get(Kind.REWARD_FUNCTION, "terminal_tests"))
    assert isinstance(reward, RewardFn)
    owner = registry.owner(Kind.DATA_SOURCE, "terminal_tasks")
    assert owner.distribution == "miles-env-terminal"


def test_data_source_yields_tasks_and_resumes() -> None:
    src = TerminalTasks(TerminalTasksOptions(tasks=["add", "reverse", "roman"], seed=3))
    it = iter(src)
    first = [next(it) for _ in range(4)]
    assert {r["task_id"] for r in first[:3]} == {"add", "reverse", "roman"}
    assert all(r["messages"][0]["content"] == r["prompt"] for r in first)
    state = src.state_dict()
    after = next(it)
    src.load_state_dict(state)
    assert next(iter(src)) == after


@pytest.mark.parametrize(
    "bad", [{"tasks": ["nope"]}, {"epochs": 0}, {"unknown": 1}], ids=["task", "epochs", "extra"]
)
def test_bad_options_are_refused(bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises((ValidationError, ValueError)):
        TerminalTasks(TerminalTasksOptions(**bad))


def _sample(**metadata) -> Sample:  # type: ignore[no-untyped-def]
    return Sample(prompt_ids=[1], metadata=dict(metadata))


def test_reward_refuses_at_build_when_isolation_is_missing() -> None:
    limits = SandboxLimits(disable_layers=["landlock"])
    with pytest.raises(SandboxUnavailable, match="filesystem"):
        TerminalTests(TerminalTestsOptions(limits=limits))


def test_reward_grades_code_in_the_response() -> None:
    sandbox_or_skip().close()
    reward = TerminalTests(TerminalTestsOptions())
    good = _sample(response_text="Here:\n```python\ndef add(a, b):\n    return a + b\n```\n")
    assert reward(good, {"task_id": "add"}) == 1.0
    assert good.metadata["terminal"]["passed"] == 5
    bad = _sample(response_text="```python\ndef add(a, b):\n    return a * b\n```")
    assert reward(bad, {"task_id": "add"}) < 1.0
    assert reward(_sample(response_text="no code"), {"task_id": "add"}) == 0.0
    nothing = _sample(response_text="42")
    assert reward(nothing, {"prompt": "What is 6 * 7?"}) == 0.0
    assert "no known task_id" in nothing.metadata["terminal"]["error"]


def test_reward_replays_commands_and_trusts_reports() -> None:
    sandbox_or_skip().close()
    reward = TerminalTests(TerminalTestsOptions())
    replay = _sample(
        terminal_commands=["echo 'def reverse_string(s): return s[::-1]' > solution.py"]
    )
    assert reward(replay, {"task_id": "reverse"}) == 1.0
    escape = _sample(
        terminal_commands=[
            "echo x > /tmp/miles_terminal_reward_escape",
            "echo 'def reverse_string(s): return s[::-1]' > solution.py",
        ]
    )
    assert reward(escape, {"task_id": "reverse"}) == 0.0
    assert "outside_dir" in escape.metadata["terminal"]["violations"]
    report = {"task_id": "reverse", "grade": 0.5, "passed": 2, "total": 4}
    assert reward(_sample(terminal_report=report), {"task_id": "reverse"}) == 0.5
