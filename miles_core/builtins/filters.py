"""Built-in filters: drop groups with no learning signal, drop truncated samples."""

from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import GroupFilter, SampleFilter
from miles_core.data import Group, Sample


class RewardVarianceOptions(BaseModel):
    """Options of the ``reward_variance`` group filter."""

    model_config = ConfigDict(extra="forbid")
    min_std: float = Field(0.0, ge=0.0, description="keep groups whose reward std exceeds this")


class RewardVariance:
    """Keeps a group only if its rewards differ: with equal rewards every GRPO-style advantage
    is zero, so the group costs a train step and teaches nothing."""

    def __init__(self, options: RewardVarianceOptions) -> None:
        self.min_std = options.min_std

    def __call__(self, group: Group) -> bool:
        rewards = [r for r in group.rewards if r is not None]
        if len(rewards) < 2:
            return False
        return statistics.pstdev(rewards) > self.min_std


class Truncated:
    """Drops samples that hit the token limit before finishing."""

    def __init__(self, _options: None) -> None:
        pass

    def __call__(self, sample: Sample) -> bool:
        return sample.finish_reason != "length"


@hookimpl
def miles_register_group_filters(register):  # type: ignore[no-untyped-def]
    register(
        GroupFilter(
            name="reward_variance",
            factory=RewardVariance,
            config=RewardVarianceOptions,
            description="drop groups whose rewards are all equal",
        )
    )


@hookimpl
def miles_register_sample_filters(register):  # type: ignore[no-untyped-def]
    register(
        SampleFilter(
            name="truncated",
            factory=Truncated,
            description="drop samples that stopped at the length limit",
        )
    )
