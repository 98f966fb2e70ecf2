"""Built-in data source: prompt records from a JSON Lines file, resumable."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import DataSource
from miles_core.errors import MilesUserError


class JsonlOptions(BaseModel):
    """Options of the ``jsonl`` data source."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(..., description="a .jsonl file, one JSON object per line")
    prompt_key: str = Field("prompt", description="field holding the prompt text or messages")
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="skip (and count) rows that are not JSON objects with prompt_key"
    )


class JsonlSource:
    """Reads every row once at start (prompt sets are small next to a run), then yields them in
    a seeded order per epoch. ``skipped`` counts malformed rows; the position is resumable."""

    def __init__(self, options: JsonlOptions) -> None:
        self.options = options
        path = Path(options.path)
        if not path.is_file():
            raise MilesUserError(f"data.path: file {options.path!r} does not exist")
        self.rows: list[dict[str, Any]] = []
        self.skipped = 0
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    ok = isinstance(row, dict) and options.prompt_key in row
                except json.JSONDecodeError:
                    ok = False
                if not ok:
                    if options.on_bad_row == "error":
                        raise MilesUserError(
                            f"data.path {options.path!r} line {lineno}: not a JSON object with "
                            f"{options.prompt_key!r}"
                        )
                    self.skipped += 1
                    continue
                self.rows.append(row)
        if not self.rows:
            raise MilesUserError(f"data.path {options.path!r} has no usable rows")
        self.epoch = 0
        self.index = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.options.shuffle:
            random.Random(self.options.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.options.epochs is None or self.epoch < self.options.epochs:
            order = self._order(self.epoch)
            while self.index < len(order):
                row = self.rows[order[self.index]]
                self.index += 1
                yield row
            self.epoch += 1
            self.index = 0

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, saved in checkpoints."""
        return {"epoch": self.epoch, "index": self.index, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


@hookimpl
def miles_register_data_sources(register):  # type: ignore[no-untyped-def]
    register(
        DataSource(
            name="jsonl",
            factory=JsonlSource,
            config=JsonlOptions,
            description="prompt records from a JSON Lines file",
        )
    )
