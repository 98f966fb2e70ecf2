"""The episode API driven by a scripted agent: correct solutions grade 1.0, wrong ones less,
and any sandbox violation (during the steps or inside the graded solution) grades 0 with its
reason recorded, while the test process carries on."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_env_terminal.episode import Episode
from miles_env_terminal.sandbox import SandboxLimits
from miles_env_terminal.tasks import TASKS

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import assert_nothing_left, sandbox_or_skip

LIMITS = SandboxLimits(wall_s=4, cpu_s=1, memory_mb=256, max_processes=16)

SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "reverse": "def reverse_string(s):\n    return s[::-1]\n",
    "fizzbuzz": textwrap.dedent(
        """
        def fizzbuzz(n):
            out = []
            for i in range(1, n + 1):
                out.append("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0
                           else "Buzz" if i % 5 == 0 else str(i))
            return out
        """
    ),
    "parse_ints": "import re\ndef parse_ints(line):\n"
    "    return [int(x) for x in re.findall(r'-?\\d+', line)]\n",
    "palindrome": "def is_palindrome(s):\n"
    "    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
    "word_count": "import re, collections\ndef word_count(text):\n"
    "    return dict(collections.Counter(re.findall('[a-z]+', text.lower())))\n",
    "max_subarray": textwrap.dedent(
        """
        def max_subarray(nums):
            best = cur = nums[0]
            for x in nums[1:]:
                cur = max(x, cur + x)
                best = max(best, cur)
            return best
        """
    ),
    "roman": textwrap.dedent(
        """
        def roman_to_int(s):
            v = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)
            total = 0
            for a, b in zip(s, s[1:] + " "):
                total += -v[a] if b != " " and v[a] < v[b] else v[a]
            return total
        """
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _isolation_available() -> None:
    sandbox_or_skip(LIMITS).close()


@pytest.fixture
def episode() -> Iterator[Episode]:
    with Episode(LIMITS) as ep:
        yield ep
    assert_nothing_left()


def write(code: str) -> str:
    """The shell command a scripted agent uses to write solution.py."""
    return f"cat > solution.py <<'MILES_EOF'\n{code}MILES_EOF"


def test_every_task_has_a_prompt_and_hidden_cases() -> None:
    assert len(TASKS) >= 6 and set(SOLUTIONS) == set(TASKS)
    for task in TASKS.values():
        assert "solution.py" in task.prompt and task.signature in task.prompt
        assert len(task.cases) >= 3


@pytest.mark.slow
def test_scripted_agent_solves_every_task(episode: Episode) -> None:
    for task_id, code in SOLUTIONS.items():
        obs = episode.reset(task_id)
        assert obs.info["task_id"] == task_id
        obs = episode.step(write(code))
        assert "exit code: 0" in obs.text
        fn = TASKS[task_id].function
        obs = episode.step(f"python3 -c 'import solution; print(callable(solution.{fn}))'")
        assert obs.result is not None and obs.result.stdout == "True\n", obs.text
        assert episode.grade() == 1.0, episode.report
        assert episode.report is not None and episode.report.passed == len(TASKS[task_id].cases)


def test_wrong_and_partial_solutions_grade_below_one(episode: Episode) -> None:
    episode.reset("add")
    episode.step(write("def add(a, b):\n    return a - b\n"))
    grade = episode.grade()
    assert 0 < grade < 1 and episode.violations == []  # add(0, 0) still passes
    episode.reset("reverse")
    assert episode.grade() == 0.0  # no solution.py at all
    assert "import failed" in episode.report.details[0]  # type: ignore[union-attr]
    episode.reset("roman")
    episode.step(write("def roman_to_int(s):\n    return True\n"))
    assert episode.grade() == 0.0  # True is not an integer answer


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("echo x > /tmp/miles_terminal_episode_escape", "outside_dir"),
        ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80))\"", "network"),
        (":(){ :|:& };:", "process_limit"),
        ("python3 -c 'while True: pass'", "cpu_time"),
        ("sleep 600", "timeout"),
        ("python3 -c 'x = bytearray(1 << 30)'", "memory"),
    ],
    ids=["write-outside", "network", "fork-bomb", "loop", "sleep", "memory"],
)
def test_a_violating_step_fails_the_episode_not_the_run(
    episode: Episode, command: str, reason: str
) -> None:
    episode.reset("add")
    obs = episode.step(command)
    assert reason in obs.info["violations"]
    # the correct solution written afterwards cannot rescue the episode
    episode.step(write(SOLUTIONS["add"]))
    assert episode.grade() == 0.0
    assert episode.report is not None and reason in episode.report.violations
    assert not os.path.exists("/tmp/miles_terminal_episode_escape")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("open('/tmp/miles_terminal_graded_escape', 'w')", "outside_dir"),
        ("import socket; socket.socket()", "network"),
        ("import os\n    while True: os.fork()", "process_limit"),
        ("while True: pass", "cpu_time"),
    ],
    ids=["write-outside", "network", "fork", "loop"],
)
def test_a_violating_solution_grades_zero(episode: Episode, body: str, reason: str) -> None:
    episode.reset("add")
    episode.step(write(f"def add(a, b):\n    {body}\n    return a + b\n"))
    assert episode.grade() == 0.0
    assert episode.report is not None and reason in episode.report.violations


def test_the_hidden_tests_cannot_be_read(episode: Episode) -> None:
    import miles_env_terminal.tasks as tasks_module

    episode.reset("add")
    obs = episode.step(f"cat {tasks_module.__file__}; ls {Path(tasks_module.__file__).parent}")
    assert obs.result is not None and obs.result.stdout == ""
    assert "Permission denied" in obs.result.stderr


def test_steps_are_bounded() -> None:
    with Episode(LIMITS, max_steps=2) as ep:
        ep.reset("add")
        assert not ep.step("true").done
        assert ep.step("true").done
        assert ep.step("true").text == "[the episode has no steps left]"
