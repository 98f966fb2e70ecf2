"""The trainer's step as the run's loop takes it: with ``run.offload`` the engines give their
memory to the trainer for the step and take it back for the weights; the trained groups leave
the ledger; the trainer's new weight version becomes the run's."""

from __future__ import annotations

import time
from typing import Any

from miles_core.data import Group
from miles_core.hooks import Hooks
from miles_core.ledger import Ledger
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.io import IOThread
from miles_core.runtime.policy import Policy
from miles_core.runtime.state import RunState


class Learner:
    """Trains the run's policy on a step's groups (see the module docstring)."""

    def __init__(
        self,
        *,
        policy: Policy,
        algorithm: Any,
        fleet: EngineFleet,
        io: IOThread,
        ledger: Ledger,
        hooks: Hooks,
        state: RunState,
        offload: bool,
    ) -> None:
        self.policy = policy
        self.algorithm = algorithm
        self.fleet = fleet
        self.io = io
        self.ledger = ledger
        self.hooks = hooks
        self.state = state
        self.offload = offload

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """Train on ``groups`` at the run's current step. Returns the step's train metrics."""
        step = self.state.step
        trainer = self.policy.trainer
        self.hooks.before_train_step(step, groups)
        t0 = time.perf_counter()
        if self.offload:  # the engines make room, then the trainer takes it back
            self.io(self.fleet.release_memory())
            self.policy.set_awake(True)
        metrics = trainer.train_step(groups, self.algorithm)
        if self.offload:  # the engines take their memory back to receive the weights
            self.io(self.fleet.resume_memory())
        seconds = time.perf_counter() - t0
        self.io(self._trained(groups))
        self.state.version = int(trainer.weight_version)
        self.hooks.after_train_step(step, groups, metrics)
        out = {f"train/{k}": float(v) for k, v in metrics.items()}
        out["time/train_s"] = seconds
        return out

    async def _trained(self, groups: list[Group]) -> None:
        # On the I/O thread, where the schedule changes the ledger too.
        for group in groups:
            self.ledger.train(group.group_id)
