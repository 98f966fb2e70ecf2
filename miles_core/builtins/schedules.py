"""The two schedules, registered like any other component; ``run.mode`` selects one."""

from __future__ import annotations

from typing import Any

from miles_core import hookimpl
from miles_core.components import Schedule


def _not_colocated(config: Any) -> str | None:
    if config.run.placement == "colocated":
        return (
            "run.mode 'async' cannot run with run.placement 'colocated': trainer and engines "
            "would need the same devices at once; use placement 'disaggregated' or mode 'sync'"
        )
    return None


@hookimpl
def miles_register_schedules(register):  # type: ignore[no-untyped-def]
    register(
        Schedule(
            name="sync",
            factory="miles_core.runtime.schedules.sync:SyncSchedule",
            description="generate a step's groups, train on them, publish the weights, repeat",
            on_policy=True,
        )
    )
    register(
        Schedule(
            name="async",
            factory="miles_core.runtime.schedules.asynchronous:AsyncSchedule",
            description="engines generate continuously into a bounded, staleness-checked buffer "
            "the trainer takes from",
            check=_not_colocated,
        )
    )
