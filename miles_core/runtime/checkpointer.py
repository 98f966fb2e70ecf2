"""Checkpoints: the trainer's state plus the run's own (step, version, data position, ledger,
judge counters, engine restarts), written so that a checkpoint is either whole or ignored."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from miles_core.ledger import BUFFERED, IN_FLIGHT, DropReason, Ledger


class Checkpointer:
    """Saves and finds the checkpoints under ``<run_dir>/checkpoints/step_<n>``."""

    def __init__(self, run_dir: Path, every: int) -> None:
        self.root = run_dir / "checkpoints"
        self.every = every

    def saved(self) -> list[Path]:
        """Complete checkpoints (their ``loop.json`` was written last), oldest first."""
        done = [p for p in self.root.glob("step_*") if (p / "loop.json").is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def has(self, step: int) -> bool:
        """Whether step ``step`` has a complete checkpoint."""
        return (self.root / f"step_{step}" / "loop.json").is_file()

    def due(self, step: int) -> bool:
        """Whether the run saves after step ``step`` (every ``checkpoint_every`` steps)."""
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, trainer: Any, state: dict[str, Any]) -> Path:
        """Write the trainer's state, then the run's ``state`` (last: it marks it complete)."""
        path = self.root / f"step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        trainer.save(str(path / "trainer"))
        tmp = path / "loop.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(path / "loop.json")
        return path

    def load(self, path: Path, trainer: Any) -> dict[str, Any]:
        """Restore the trainer from ``path`` and return the run's state. Groups the checkpoint
        has in flight or queued died with the process that held them: they are dropped as
        ``interrupted`` in the restored ledger (``state["ledger"]`` is a :class:`Ledger`)."""
        trainer.load(str(path / "trainer"))
        state: dict[str, Any] = json.loads((path / "loop.json").read_text())
        ledger = Ledger.from_state_dict(state["ledger"])
        for gid, where in state["ledger"]["state"].items():
            if where in (IN_FLIGHT, BUFFERED):
                ledger.drop(int(gid), DropReason.INTERRUPTED)
        state["ledger"] = ledger
        return state


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """A new run (not ``--resume``) starts in an empty folder: what an earlier run of the same
    name left there (metrics, checkpoints, ledger) is renamed to ``<name>.<UTC time>`` beside
    it, not overwritten or mixed in. Returns the new name, or ``None`` when there was nothing."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.{stamp}.{n}")
    run_dir.rename(target)
    return target
