"""The user extension points: rewards, filters, prompt sources, metric writers, rollouts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from miles_core.data import Group, Sample


@runtime_checkable
class RewardFn(Protocol):
    """Scores one finished sample. Returns the reward; may also write details into
    ``sample.metadata``. A raising reward function marks the sample as failed, not the run."""

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float: ...


@runtime_checkable
class SampleFilterFn(Protocol):
    """Returns True to keep a sample (applied before its group is judged)."""

    def __call__(self, sample: Sample) -> bool: ...


@runtime_checkable
class GroupFilterFn(Protocol):
    """Returns True to keep a group; a dropped group is recorded in the ledger as ``filtered``."""

    def __call__(self, group: Group) -> bool: ...


@runtime_checkable
class PromptSource(Protocol):
    """An endless or finite stream of prompt records (dicts with at least ``prompt`` or
    ``messages``), resumable from its state."""

    #: malformed rows skipped so far (reported as ``data/skipped_rows``)
    skipped: int

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class MetricWriter(Protocol):
    """Receives the metrics of every step; ``open`` is called once with the run's folder."""

    def open(self, run_dir: str) -> None: ...

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class RolloutFn(Protocol):
    """Generates and scores one group for one prompt record on the given engine client.

    ``context`` carries what the loop knows and a rollout may use: ``family`` (the built model
    family: render, tokenize, decode, stop tokens), ``modality`` (the built modality: what a
    sample is, e.g. the diffusion sampler's settings), ``sampling_params`` (from the run
    config's ``rollout`` section), ``step``. Accept ``**context`` and ignore what you do not
    need.
    """

    async def __call__(
        self,
        prompt: Mapping[str, Any],
        *,
        group_size: int,
        engine: Any,
        reward: RewardFn,
        **context: Any,
    ) -> Group: ...
