"""The schedules: how rollout and training interleave. Each is a registered component
(:mod:`miles_core.builtins.schedules`) that the run config's ``run.mode`` selects; a schedule
hands the run whole groups, and publishes the weights the way its engines need (the fleet does
the publishing). :class:`Feed` is a schedule as the run's loop takes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_core.config import RunConfig
from miles_core.data import Group
from miles_core.hooks import Hooks
from miles_core.ledger import Ledger
from miles_core.runtime.control import Control
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.io import IOThread
from miles_core.runtime.judge import Judge
from miles_core.runtime.policy import Policy
from miles_core.runtime.rollouts import Rollouts
from miles_core.runtime.state import RunState


@dataclass
class ScheduleContext:
    """What a schedule works with: the run's config, its engines, where groups come from,
    where they are judged, and the ledger."""

    config: RunConfig
    fleet: EngineFleet
    rollouts: Rollouts
    judge: Judge
    ledger: Ledger
    log: Callable[[str], None]


class Feed:
    """The run's schedule, run on the I/O thread, as the loop takes it: a step's groups, the
    new weights published (the trainer sleeps while the engines generate when
    ``run.offload`` is set), and generation stopped."""

    def __init__(
        self,
        schedule: Any,
        *,
        io: IOThread,
        policy: Policy,
        hooks: Hooks,
        state: RunState,
        offload: bool,
        log: Callable[[str], None],
        control: Control | None = None,
    ) -> None:
        self.schedule = schedule
        self.control = control
        self.io = io
        self.policy = policy
        self.hooks = hooks
        self.state = state
        self.offload = offload
        self.log = log

    def next_batch(self) -> tuple[list[Group], dict[str, float]]:
        """The groups the run's current step trains on, with the rollout's metrics (requests
        to the running job, engines joining or leaving, applied first)."""
        if self.control is not None:
            self.io(self.control.poll())
        batch: tuple[list[Group], dict[str, float]] = self.io(
            self.schedule.next_batch(self.state.step)
        )
        return batch

    def publish(self) -> dict[str, float]:
        """The engines get the trainer's new weights the way the schedule needs."""
        state = self.state
        metrics: dict[str, float] = self.io(self.schedule.publish(state.version))
        if self.offload:
            self.policy.set_awake(False)
        self.hooks.after_weight_sync(state.step, state.version, metrics)
        return metrics

    def stop(self) -> None:
        """Stop generating (what is in flight is dropped as ``run_ended``)."""
        self.io(self.schedule.stop())

    def close(self) -> None:
        """Stop the schedule as the run closes; a failure it reports fails a run that was
        completing, and is logged when the run is already failing for another reason."""
        try:
            self.stop()
        except Exception as exc:
            if self.state.status == "completed":
                raise
            self.log(f"stopping the schedule: {exc!r}")
