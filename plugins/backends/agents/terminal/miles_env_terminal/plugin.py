"""Registration with Miles: the ``terminal_tasks`` data source and the ``terminal_tests`` reward.

The data source yields one prompt record per task (``prompt``, ``messages``, ``task_id``); an
agent rollout drives an :class:`~miles_env_terminal.episode.Episode` with them. The reward
grades a finished sample by, in order of preference: the episode's own grade report left in
``sample.metadata['terminal_report']`` by a rollout that ran the episode itself; a replay in a
fresh sandbox of the commands in ``sample.metadata['terminal_commands']``, or else of the
``shell`` tool calls in the transcript ``sample.metadata['messages']`` (what the ``session``
rollout with :func:`miles_env_terminal.agent.terminal_agent` leaves); or the last fenced code
block of the response written as ``solution.py``. The details go to ``sample.metadata['terminal']``.
"""

from __future__ import annotations

import base64
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import DataSource, RewardFunction
from miles_core.data import Sample
from miles_env_terminal.agent import shell_command
from miles_env_terminal.episode import Episode
from miles_env_terminal.sandbox import Sandbox, SandboxLimits
from miles_env_terminal.tasks import TASKS


class TerminalTasksOptions(BaseModel):
    """Options of the ``terminal_tasks`` data source."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[str] | None = Field(None, description="task ids to use (None = all)")
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")


class TerminalTasks:
    """The coding tasks as prompt records, in a seeded order per epoch; resumable."""

    #: malformed rows skipped: a generated task set has none
    skipped = 0

    def __init__(self, options: TerminalTasksOptions) -> None:
        self.options = options
        ids = options.tasks if options.tasks is not None else list(TASKS)
        unknown = [t for t in ids if t not in TASKS]
        if unknown or not ids:
            raise ValueError(
                f"data.options.tasks: unknown or empty {unknown or ids}; known: {', '.join(TASKS)}"
            )
        self.ids = list(ids)
        self.epoch = 0
        self.index = 0

    def _order(self, epoch: int) -> list[str]:
        order = list(self.ids)
        if self.options.shuffle:
            random.Random(self.options.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.options.epochs is None or self.epoch < self.options.epochs:
            order = self._order(self.epoch)
            while self.index < len(order):
                task = TASKS[order[self.index]]
                self.index += 1
                yield {
                    "prompt": task.prompt,
                    "messages": [{"role": "user", "content": task.prompt}],
                    "task_id": task.task_id,
                    "environment": "terminal",
                }
            self.epoch += 1
            self.index = 0

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class TerminalTestsOptions(BaseModel):
    """Options of the ``terminal_tests`` reward."""

    model_config = ConfigDict(extra="forbid")
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    python: str = Field("python3", description="interpreter the hidden tests run with")
    trust_episode_report: bool = Field(
        True, description="use the grade the rollout's episode already computed"
    )
    max_steps: int = Field(32, ge=1, description="commands replayed at most")


def transcript_commands(messages: object) -> list[str] | None:
    """The commands of the ``shell`` tool calls in a chat transcript, in order; ``None`` when
    the transcript has none (or there is no transcript)."""
    if not isinstance(messages, list):
        return None
    commands = []
    for message in messages:
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                command = shell_command(call) if isinstance(call, Mapping) else None
                if command is not None:
                    commands.append(command)
    return commands or None


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class TerminalTests:
    """Grades a finished terminal episode with the task's hidden tests (see module doc)."""

    def __init__(self, options: TerminalTestsOptions) -> None:
        self.options = options
        # loud at start: a machine that cannot isolate a required property refuses the run
        # here (SandboxUnavailable names the property), not sample by sample later
        with Sandbox(options.limits) as probe:
            self.mechanisms = probe.mechanisms
            self.warnings = probe.warnings

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        task_id = prompt.get("task_id") or sample.metadata.get("task_id")
        if task_id not in TASKS:
            sample.metadata["terminal"] = {"error": f"no known task_id in the prompt: {task_id!r}"}
            return 0.0
        report = sample.metadata.get("terminal_report")
        if (
            self.options.trust_episode_report
            and isinstance(report, Mapping)
            and report.get("task_id") == task_id
        ):
            sample.metadata["terminal"] = dict(report)
            return float(report["grade"])
        commands = sample.metadata.get("terminal_commands")
        if not isinstance(commands, list):
            commands = transcript_commands(sample.metadata.get("messages"))
        if not commands:
            text = sample.metadata.get("response_text")
            blocks = _FENCE.findall(text) if isinstance(text, str) else []
            if not blocks:
                sample.metadata["terminal"] = {"task_id": task_id, "error": "no code found"}
                return 0.0
            code = base64.b64encode(blocks[-1].encode()).decode()
            commands = [f"echo {code} | base64 -d > solution.py"]
        with Episode(self.options.limits, max_steps=self.options.max_steps) as episode:
            episode.reset(task_id)
            for command in commands[: self.options.max_steps]:
                episode.step(str(command))
            grade = episode.grade()
            assert episode.report is not None
            sample.metadata["terminal"] = episode.report.to_dict()
        return grade


@hookimpl
def miles_register_data_sources(register):  # type: ignore[no-untyped-def]
    register(
        DataSource(
            name="terminal_tasks",
            factory=TerminalTasks,
            config=TerminalTasksOptions,
            description="small coding tasks for the sandboxed terminal environment",
        )
    )


@hookimpl
def miles_register_reward_functions(register):  # type: ignore[no-untyped-def]
    register(
        RewardFunction(
            name="terminal_tests",
            factory=TerminalTests,
            config=TerminalTestsOptions,
            description="grade a terminal episode by its task's hidden tests in the sandbox",
        )
    )
