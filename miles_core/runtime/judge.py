"""The one place that decides whether a finished group is kept, and if not, why.

Both schedules judge every group here, at the moment it finishes, before it is trained or
buffered; the reasons are :class:`~miles_core.ledger.DropReason`. The buffer's staleness check
at removal and the end of a run are the only other drops, and they use the same enum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_core.data import Group
from miles_core.hooks import Hooks
from miles_core.ledger import DropReason


def failure_reason(group: Group) -> DropReason | None:
    """Why a group whose samples did not all finish cannot be trained on, or ``None``.

    A sample fails in four ways, told apart by what the rollout recorded: its request was
    aborted (``finish_reason == "abort"``), the reward function raised on it
    (``metadata["reward_error"]``), its request failed on the engine (any other failure), or
    the teacher's engine could not score it (``metadata["teacher_error"]``)."""
    if not group.failed:
        if any("teacher_error" in s.metadata for s in group.samples):
            return DropReason.TEACHER_FAILED
        return None
    if any("reward_error" in s.metadata for s in group.samples):
        return DropReason.REWARD_FAILED
    if any(s.finish_reason == "abort" for s in group.samples):
        return DropReason.ABORTED
    return DropReason.ENGINE_FAILED


class Judge:
    """Judges finished groups: counts their samples and reward failures, announces them
    (``miles_group_finished``), applies the sample filters, then the group filters."""

    def __init__(
        self, hooks: Hooks, sample_filters: Sequence[Any], group_filters: Sequence[Any]
    ) -> None:
        self.hooks = hooks
        self.sample_filters = list(sample_filters)
        self.group_filters = list(group_filters)
        self.samples_seen = 0
        self.reward_failures = 0

    def verdict(self, group: Group, step: int) -> DropReason | None:
        """The reason ``group`` is dropped, or ``None`` to keep it."""
        self.samples_seen += len(group.samples)
        self.reward_failures += sum("reward_error" in s.metadata for s in group.samples)
        self.hooks.group_finished(group, step)
        reason = failure_reason(group)
        if reason is not None:
            return reason
        for keep in self.sample_filters:
            group.samples = [s for s in group.samples if keep(s)]
        if not group.samples or not all(f(group) for f in self.group_filters):
            return DropReason.FILTERED
        return None

    @property
    def reward_failure_rate(self) -> float:
        """Share of the samples seen whose reward function raised."""
        return self.reward_failures / max(self.samples_seen, 1)

    def state_dict(self) -> dict[str, int]:
        """The counters, saved in checkpoints."""
        return {"samples_seen": self.samples_seen, "reward_failures": self.reward_failures}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.samples_seen = int(state.get("samples_seen", 0))
        self.reward_failures = int(state.get("reward_failures", 0))
