"""reasoning-gym as a data source and a reward: offline problem generators with their own
scorers. The package is imported only when a run selects them (``pip install reasoning-gym``)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import DataSource, RewardFunction
from miles_core.data import Sample
from miles_core.errors import MilesUserError


def _import() -> Any:
    try:
        import reasoning_gym  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise MilesUserError(
            "data source / reward 'reasoning_gym' needs the reasoning-gym package: "
            "pip install reasoning-gym"
        ) from None
    return reasoning_gym


class ReasoningGymOptions(BaseModel):
    """Options of the ``reasoning_gym`` data source."""

    model_config = ConfigDict(extra="forbid")
    task: str = Field(..., description="a reasoning-gym dataset name, e.g. chain_sum")
    size: int = Field(1000, ge=1, description="problems per epoch")
    seed: int = Field(0, description="generator seed; use another seed for a held-out set")
    task_config: dict[str, Any] = Field(default_factory=dict, description="the task's options")
    prompt_suffix: str = Field("", description="appended to every question")
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")


class ReasoningGymSource:
    """Yields ``{"prompt", "answer", "entry"}`` records; the entry goes to the reward's scorer."""

    #: malformed rows skipped: a generated task set has none
    skipped = 0

    def __init__(self, options: ReasoningGymOptions) -> None:
        rg = _import()
        self.options = options
        try:
            self.dataset = rg.create_dataset(
                options.task, seed=options.seed, size=options.size, **options.task_config
            )
        except Exception as exc:  # an unknown task or option is the user's to fix
            raise MilesUserError(f"data.task {options.task!r}: {exc}") from None
        self.epoch = 0
        self.index = 0

    def record(self, i: int) -> dict[str, Any]:
        """The prompt record of problem ``i``."""
        entry = self.dataset[i]
        return {
            "prompt": f"{entry['question']}{self.options.prompt_suffix}",
            "answer": entry["answer"],
            "entry": entry,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.options.epochs is None or self.epoch < self.options.epochs:
            while self.index < self.options.size:
                self.index += 1
                yield self.record(self.index - 1)
            self.epoch += 1
            self.index = 0

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class ReasoningGymRewardOptions(BaseModel):
    """Options of the ``reasoning_gym`` reward."""

    model_config = ConfigDict(extra="forbid")
    extract: str = Field(
        "last_number",
        pattern="^(last_number|full)$",
        description="what of the response is scored: the last number in it, or all of it",
    )


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ReasoningGymReward:
    """Scores with the problem's own reasoning-gym scorer."""

    def __init__(self, options: ReasoningGymRewardOptions) -> None:
        self.rg = _import()
        self.options = options
        self._datasets: dict[str, Any] = {}

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        entry = prompt["entry"]
        text = str(sample.metadata.get("response_text", ""))
        if self.options.extract == "last_number":
            found = _NUMBER.findall(text)
            text = found[-1] if found else ""
        name = entry["metadata"]["source_dataset"]
        if name not in self._datasets:  # the scorer is a method of the task's dataset
            self._datasets[name] = self.rg.create_dataset(name, size=1, seed=0)
        return float(self._datasets[name].score_answer(answer=text, entry=entry))


@hookimpl
def miles_register_data_sources(register):  # type: ignore[no-untyped-def]
    register(
        DataSource(
            name="reasoning_gym",
            factory=ReasoningGymSource,
            config=ReasoningGymOptions,
            description="problems from a reasoning-gym generator",
        )
    )


@hookimpl
def miles_register_reward_functions(register):  # type: ignore[no-untyped-def]
    register(
        RewardFunction(
            name="reasoning_gym",
            factory=ReasoningGymReward,
            config=ReasoningGymRewardOptions,
            description="the reasoning-gym task's own scorer",
        )
    )
