"""Built-in metric sinks: a JSON Lines file in the run folder, and a per-step line on stdout."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import MetricSink
from miles_core.errors import MilesUserError


class JsonlSinkOptions(BaseModel):
    """Options of the ``jsonl`` metric sink."""

    model_config = ConfigDict(extra="forbid")
    filename: str = Field("metrics.jsonl", description="file inside the run folder")


class JsonlSink:
    """Appends one JSON object per step (``step``, ``time`` and every metric), flushed at once so
    a run that dies keeps every step it finished."""

    def __init__(self, options: JsonlSinkOptions) -> None:
        self.options = options
        self._fh: IO[str] | None = None

    def open(self, run_dir: str) -> None:
        """Open (append) the file in the run folder."""
        path = Path(run_dir) / self.options.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one step."""
        if self._fh is None:
            raise RuntimeError("JsonlSink.write before open")
        self._fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class StdoutSinkOptions(BaseModel):
    """Options of the ``stdout`` metric sink."""

    model_config = ConfigDict(extra="forbid")
    keys: list[str] = Field(default_factory=list, description="metrics to print; empty = all")


class StdoutSink:
    """Prints one line per step: ``step 3 | reward/mean 0.42 | ...``."""

    def __init__(self, options: StdoutSinkOptions) -> None:
        self.keys = options.keys

    def open(self, run_dir: str) -> None:
        """Nothing to open."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print one step."""
        keys = self.keys or sorted(metrics)
        items = " | ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)
        print(f"step {step} | {items}", file=sys.stdout, flush=True)

    def close(self) -> None:
        """Nothing to close."""


class TensorBoardSinkOptions(BaseModel):
    """Options of the ``tensorboard`` metric sink."""

    model_config = ConfigDict(extra="forbid")
    subdir: str = Field("tensorboard", description="event-file folder inside the run folder")


class TensorBoardSink:
    """TensorBoard event files (``tensorboard --logdir <run folder>``), one scalar per metric.
    Uses torch's SummaryWriter, imported when the run opens the sink (needs the tensorboard
    package)."""

    def __init__(self, options: TensorBoardSinkOptions) -> None:
        self.options = options
        self._writer: Any = None

    def open(self, run_dir: str) -> None:
        """Create the writer in the run folder."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MilesUserError(
                f"metric sink 'tensorboard' needs torch and tensorboard ({exc}): "
                "pip install tensorboard"
            ) from None
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / self.options.subdir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """One scalar per metric at ``step``."""
        if self._writer is None:
            raise RuntimeError("TensorBoardSink.write before open")
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Close the writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@hookimpl
def miles_register_metric_sinks(register):  # type: ignore[no-untyped-def]
    register(
        MetricSink(
            name="jsonl",
            factory=JsonlSink,
            config=JsonlSinkOptions,
            description="metrics.jsonl in the run folder",
            essential=True,
        )
    )
    register(
        MetricSink(
            name="stdout",
            factory=StdoutSink,
            config=StdoutSinkOptions,
            description="one line per step on stdout",
        )
    )
    register(
        MetricSink(
            name="tensorboard",
            factory=TensorBoardSink,
            config=TensorBoardSinkOptions,
            description="TensorBoard event files in the run folder",
        )
    )
