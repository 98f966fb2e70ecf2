"""The schedules: how rollout and training interleave. Each is a registered component
(:mod:`miles_core.builtins.schedules`) that the run config's ``run.mode`` selects; a schedule
hands the run whole groups, and publishes the weights the way its engines need (the fleet does
the publishing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles_core.config import RunConfig
from miles_core.ledger import Ledger
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.judge import Judge
from miles_core.runtime.rollouts import Rollouts


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
