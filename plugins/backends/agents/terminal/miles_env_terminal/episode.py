"""The episode API an agent harness drives: ``reset(task)``, ``step(command)``, ``grade()``.

One episode owns one :class:`~miles_env_terminal.sandbox.Sandbox` (a fresh scratch directory).
Every command's limits are recorded; a single violation (timeout, network, access outside the
directory, process or memory limit...) makes the episode's grade 0 whatever its tests say, and
the reasons stay in :attr:`Episode.violations`. A violation never raises: it fails the episode,
not the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_env_terminal.sandbox import RunResult, Sandbox, SandboxLimits
from miles_env_terminal.tasks import TASKS, GradeReport, Task, run_hidden_tests


@dataclass
class Observation:
    """What the agent sees after ``reset`` or ``step``: ``text`` for the model, the raw
    ``result`` of the command (``None`` after reset) and whether the episode is ``done``."""

    text: str
    result: RunResult | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def render(result: RunResult) -> str:
    """The text an agent reads for one command's result."""
    parts = [f"exit code: {result.exit_code}"]
    if result.stdout:
        parts.append("stdout:\n" + result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.truncated:
        parts.append("[output truncated]")
    if result.killed_reason:
        parts.append(f"[stopped by the sandbox: {result.killed_reason}]")
    return "\n".join(parts)


class Episode:
    """One task attempted in one sandbox.

    ``max_steps`` bounds the commands; the step that reaches it returns ``done=True``. Call
    :meth:`close` (or use ``with``) to remove the scratch directory.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_steps: int = 16,
        python: str = "python3",
        base_dir: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.max_steps = max_steps
        self.python = python
        self.base_dir = base_dir
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.steps = 0
        self.violations: list[str] = []
        self.history: list[tuple[str, RunResult]] = []
        self.report: GradeReport | None = None

    def reset(self, task: Task | str | dict[str, Any]) -> Observation:
        """Start the task (a :class:`Task`, its id, or a prompt record with ``task_id``) in a
        fresh sandbox; returns the prompt as the first observation."""
        if isinstance(task, dict):
            task = str(task["task_id"])
        if isinstance(task, str):
            if task not in TASKS:
                raise KeyError(f"unknown terminal task {task!r}; known: {', '.join(TASKS)}")
            task = TASKS[task]
        self.close()
        self.task = chosen = task
        self.sandbox = Sandbox(self.limits, base_dir=self.base_dir)
        self.steps, self.violations, self.history, self.report = 0, [], [], None
        return Observation(chosen.prompt, info={"task_id": chosen.task_id})

    def step(self, command: str) -> Observation:
        """Run one shell command in the episode's sandbox."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.steps >= self.max_steps:
            return Observation("[the episode has no steps left]", done=True)
        self.steps += 1
        result = self.sandbox.run(command)
        self.history.append((command, result))
        for v in result.violations:
            if v not in self.violations:
                self.violations.append(v)
        return Observation(
            render(result),
            result=result,
            done=self.steps >= self.max_steps,
            info={"violations": list(result.violations)},
        )

    def grade(self) -> float:
        """Run the hidden tests in the sandbox and return the grade: the fraction of cases
        passed, or 0 when any step or the tests ran into a sandbox limit. The details are in
        :attr:`report`."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("call reset(task) before grade()")
        report = run_hidden_tests(self.task, self.sandbox, python=self.python)
        for v in report.violations:
            if v not in self.violations:
                self.violations.append(v)
        report.violations = list(self.violations)
        if self.violations:
            report.grade = 0.0
        self.report = report
        return report.grade

    def close(self) -> None:
        """Remove the sandbox's scratch directory."""
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
