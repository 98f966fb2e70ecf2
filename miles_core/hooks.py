"""The typed facade over the lifecycle hooks: the rest of Miles calls hooks only through it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.contracts import EngineLauncher, Trainer, WeightTransport
    from miles_core.data import Group


class Hooks:
    """One typed method per lifecycle and placement hook of :mod:`miles_core.hookspecs`."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._hook = pm.hook

    def configure(self, config: RunConfig) -> None:
        """Announce the validated config (historic: late plugins still see it)."""
        self._hook.miles_configure.call_historic(kwargs={"config": config})

    def place(
        self, config: RunConfig, launcher: EngineLauncher
    ) -> tuple[Trainer, WeightTransport, EngineLauncher] | None:
        """Ask the placement plugins where the trainer, its sender and the engines run (the
        first answer wins); ``None``: build them in this process."""
        placed = self._hook.miles_place(config=config, launcher=launcher)
        if placed is None:
            return None
        trainer, transport, placed_launcher = placed
        return trainer, transport, placed_launcher

    def placement_record(self, config: RunConfig) -> list[dict[str, Any]]:
        """Every placement plugin's records of the processes it started (see the hookspec)."""
        answers = self._hook.miles_placement_record(config=config)
        return [record for answer in answers if answer for record in answer]

    def engines_to_add(self, config: RunConfig, engines: int) -> int:
        """How many engines the placement plugins would add now (the answers summed; see the
        hookspec)."""
        answers = self._hook.miles_engines_to_add(config=config, engines=engines)
        return sum(int(a) for a in answers if a)

    def run_start(self, config: RunConfig, run_dir: str) -> None:
        """A run starts."""
        self._hook.miles_run_start(config=config, run_dir=run_dir)

    def run_end(self, config: RunConfig, run_dir: str, status: str) -> None:
        """A run ends (``completed``, ``failed`` or ``interrupted``)."""
        self._hook.miles_run_end(config=config, run_dir=run_dir, status=status)

    def group_finished(self, group: Group, step: int) -> None:
        """A group was generated and scored."""
        self._hook.miles_group_finished(group=group, step=step)

    def before_train_step(self, step: int, groups: list[Group]) -> None:
        """A train step is about to consume ``groups``."""
        self._hook.miles_before_train_step(step=step, groups=groups)

    def after_train_step(
        self, step: int, groups: list[Group], metrics: Mapping[str, float]
    ) -> None:
        """A train step finished."""
        self._hook.miles_after_train_step(step=step, groups=groups, metrics=metrics)

    def after_weight_sync(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        """The engines serve weight ``version``."""
        self._hook.miles_after_weight_sync(step=step, version=version, metrics=metrics)

    def metrics_emitted(self, step: int, metrics: Mapping[str, float]) -> None:
        """A step's metrics were written to every sink."""
        self._hook.miles_metrics_emitted(step=step, metrics=metrics)
