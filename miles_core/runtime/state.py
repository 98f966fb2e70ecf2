"""Where a run is (its step, the weight version, how it ends) and what it saves of itself: a
checkpoint of a step, and at the end each adapter and the exported policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miles_core.config import RunConfig
from miles_core.data import next_free_group_id
from miles_core.ledger import Ledger
from miles_core.runtime.checkpointer import Checkpointer
from miles_core.runtime.export import export_policy, save_adapters
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.io import IOThread
from miles_core.runtime.judge import Judge
from miles_core.runtime.policy import Policy

Status = Literal["failed", "interrupted", "completed"]


@dataclass
class RunState:
    """The run's position: the last step begun, the weight version the trainer last made,
    and how the run ends (``failed`` until it completes or is interrupted)."""

    step: int = 0
    version: int = 0
    status: Status = "failed"
    #: whether this run's state is loaded: a resumed run writes nothing over its folder's
    #: record before its checkpoint has loaded
    loaded: bool = True


class Saver:
    """Checkpoints of the run (the trainer's state, then the run's; several adapters each
    also in PEFT's format, in its own folder) and the outputs of a completed run."""

    def __init__(
        self,
        config: RunConfig,
        *,
        state: RunState,
        checkpointer: Checkpointer,
        policy: Policy,
        io: IOThread,
        data: Any,
        ledger: Ledger,
        judge: Judge,
        fleet: EngineFleet,
        model_path: str,
        run_dir: Path,
    ) -> None:
        self.config = config
        self.state = state
        self.checkpointer = checkpointer
        self.policy = policy
        self.io = io
        self.data = data
        self.ledger = ledger
        self.judge = judge
        self.fleet = fleet
        self.model_path = model_path
        self.run_dir = run_dir

    def due(self) -> bool:
        """Whether the run saves after its current step."""
        return self.checkpointer.due(self.state.step)

    def save(self) -> Path:
        """A checkpoint of the current step."""
        save_adapters(self.policy, self.config, f"step_{self.state.step}")
        return self.checkpointer.save(self.state.step, self.policy, self.io(self._snapshot()))

    async def _snapshot(self) -> dict[str, Any]:
        # On the I/O thread: the ledger and the fleet change there.
        return {
            "step": self.state.step,
            "version": self.state.version,
            "data": self.data.state_dict(),
            "ledger": self.ledger.state_dict(),
            "engine_restarts": self.fleet.restarts,
            "next_group_id": next_free_group_id(),
            **self.judge.state_dict(),
        }

    def outputs(self) -> dict[str, str]:
        """A completed run's outputs: each adapter in its folder, and with ``run.export`` the
        policy as a Hugging Face checkpoint; their paths by name."""
        out = save_adapters(self.policy, self.config)
        if self.config.run.export:
            out.update(export_policy(self.policy, self.model_path, self.run_dir, self.config))
        return out

    def close(self) -> None:
        """A completed run whose last step has no checkpoint gets one."""
        step = self.state.step
        if self.state.status == "completed" and step and not self.checkpointer.has(step):
            self.save()
