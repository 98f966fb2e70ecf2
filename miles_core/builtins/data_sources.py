"""Built-in data sources: prompt records from a JSON Lines file, a Parquet file, or a Python
generator, each resumable from the position saved in a checkpoint.

Malformed rows are skipped and counted rather than fatal (``on_bad_row: skip``, the default).
A prompt set converted from elsewhere often carries a handful of broken rows, and refusing a
long run for them costs more than training without them, provided the loss is visible: the
source prints a warning naming the file, the count and the first bad line (or row) when it is
built, the loop reports the count as the ``data/skipped_rows`` metric of every step and as
``skipped_rows`` in the final summary. A file without a single usable row is refused (exit
code 2), and ``on_bad_row: error`` refuses the first bad row instead.
"""

from __future__ import annotations

import importlib
import itertools
import json
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import DataSource
from miles_core.errors import MilesUserError


def usable(row: object, prompt_key: str) -> bool:
    """A prompt record: a mapping whose ``prompt_key`` (or ``messages``) holds text or a
    non-empty list of chat messages."""
    if not isinstance(row, Mapping):
        return False
    value = row.get(prompt_key, row.get("messages"))
    return isinstance(value, str) or (isinstance(value, list) and bool(value))


def warn_skipped(what: str, skipped: int, first_bad: str, prompt_key: str) -> None:
    """The warning a source prints when it skipped malformed rows."""
    print(
        f"miles: warning: {what}: skipped {skipped} malformed row{'s' * (skipped != 1)} "
        f"(first at {first_bad}); a row must be an object with {prompt_key!r} (text or "
        "messages); set on_bad_row: error to refuse them instead",
        file=sys.stderr,
        flush=True,
    )


class _FileOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_key: str = Field("prompt", description="field holding the prompt text or messages")
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="skip (and count) rows without a usable prompt_key, or refuse them"
    )


class JsonlOptions(_FileOptions):
    """Options of the ``jsonl`` data source."""

    path: str = Field(..., description="a .jsonl file, one JSON object per line")


class ParquetOptions(_FileOptions):
    """Options of the ``parquet`` data source."""

    path: str = Field(..., description="a .parquet file (read with the datasets library)")


class _EpochSource:
    """Yields ``len(self)`` rows in a seeded order per epoch; the position is resumable.
    Subclasses fill ``self.options``, ``self.skipped`` and the row access."""

    options: _FileOptions
    skipped: int

    def __init__(self) -> None:
        self.epoch = 0
        self.index = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of the usable rows."""
        raise NotImplementedError

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self)))
        if self.options.shuffle:
            random.Random(self.options.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.options.epochs is None or self.epoch < self.options.epochs:
            order = self._order(self.epoch)
            while self.index < len(order):
                row = self.row(order[self.index])
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


def _refuse_empty(what: str, skipped: int, first_bad: str | None, prompt_key: str) -> None:
    detail = f"{skipped} malformed, the first at {first_bad}" if first_bad else "it is empty"
    raise MilesUserError(
        f"{what} has no usable rows ({detail}); a row must be an object with {prompt_key!r} "
        "(text or messages)"
    )


class JsonlSource(_EpochSource):
    """Reads every row once at start (prompt sets are small next to a run), then yields them in
    a seeded order per epoch. ``skipped`` counts malformed rows; the position is resumable."""

    def __init__(self, options: JsonlOptions) -> None:
        super().__init__()
        self.options = options
        path = Path(options.path)
        if not path.is_file():
            raise MilesUserError(f"data.path: file {options.path!r} does not exist")
        what = f"data file {options.path!r}"
        self.rows: list[dict[str, Any]] = []
        self.skipped = 0
        first_bad: str | None = None
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if not usable(row, options.prompt_key):
                    if options.on_bad_row == "error":
                        raise MilesUserError(
                            f"data.path {options.path!r} line {lineno}: not a JSON object with "
                            f"{options.prompt_key!r}"
                        )
                    self.skipped += 1
                    first_bad = first_bad or f"line {lineno}"
                    continue
                self.rows.append(row)
        if not self.rows:
            _refuse_empty(what, self.skipped, first_bad, options.prompt_key)
        if first_bad:
            warn_skipped(what, self.skipped, first_bad, options.prompt_key)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of the usable rows."""
        return self.rows[i]


class ParquetSource(_EpochSource):
    """A Parquet file opened with the ``datasets`` library (memory-mapped Arrow, so a large
    prompt set is not copied into Python objects); usable rows are found once from the prompt
    column and read one at a time. Same order, epochs and resumable position as ``jsonl``."""

    def __init__(self, options: ParquetOptions) -> None:
        super().__init__()
        self.options = options
        if not Path(options.path).is_file():
            raise MilesUserError(f"data.path: file {options.path!r} does not exist")
        try:
            import datasets  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            raise MilesUserError(
                "data source 'parquet' needs the datasets library: "
                "pip install 'miles-core[datasets]'"
            ) from None
        what = f"data file {options.path!r}"
        try:
            self.dataset = datasets.Dataset.from_parquet(options.path)
        except Exception as exc:  # not Parquet, or unreadable
            raise MilesUserError(f"{what}: cannot be read as Parquet: {exc}") from None
        key = options.prompt_key
        columns = list(self.dataset.column_names)
        if key not in columns and "messages" not in columns:
            raise MilesUserError(
                f"{what} has no column {key!r} (columns: {', '.join(columns)}); set prompt_key"
            )
        prompts = self.dataset[key if key in columns else "messages"]
        self.valid: list[int] = []
        self.skipped = 0
        first_bad: str | None = None
        for i, value in enumerate(prompts):
            if isinstance(value, str) or (isinstance(value, list) and value):
                self.valid.append(i)
                continue
            if options.on_bad_row == "error":
                raise MilesUserError(
                    f"data.path {options.path!r} row {i + 1}: no usable {key!r} (got {value!r})"
                )
            self.skipped += 1
            first_bad = first_bad or f"row {i + 1}"
        if not self.valid:
            _refuse_empty(what, self.skipped, first_bad, key)
        if first_bad:
            warn_skipped(what, self.skipped, first_bad, key)

    def __len__(self) -> int:
        return len(self.valid)

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of the usable rows."""
        return dict(self.dataset[self.valid[i]])


class GeneratorOptions(BaseModel):
    """Options of the ``generator`` data source."""

    model_config = ConfigDict(extra="forbid")
    function: str = Field(
        ...,
        pattern=r"^[\w.]+:[\w.]+$",
        description="'module:function', called as function(seed=seed, **kwargs); it returns or "
        "yields prompt records (dicts); the module must be importable (installed or on "
        "PYTHONPATH)",
    )
    seed: int = 0
    kwargs: dict[str, Any] = Field(default_factory=dict, description="more keyword arguments")
    prompt_key: str = Field("prompt", description="field holding the prompt text or messages")
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="skip (and count) records without a usable prompt_key, or refuse them"
    )
    max_bad_in_a_row: int = Field(
        1000, ge=1, description="this many malformed records in a row stop the run"
    )


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``module:attribute`` (dotted attribute allowed); a clear error otherwise."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise MilesUserError(
            f"data.function {spec!r}: cannot import {module_name!r} ({exc}); install it or put "
            "its folder on PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MilesUserError(f"data.function {spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise MilesUserError(f"data.function {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


class GeneratorSource:
    """Prompt records from a user's function, e.g. a procedurally generated task. The function
    gets the seed, so the stream is the same every time; the position is the number of records
    consumed, and a resumed run calls the function again and skips that many. Malformed records
    are skipped and counted like a file's bad rows."""

    def __init__(self, options: GeneratorOptions) -> None:
        self.options = options
        self.function = load_function(options.function)
        self.consumed = 0  # records taken from the function, malformed ones included
        self.skipped = 0
        self._warned = False

    def _stream(self) -> Iterator[Any]:
        produced = self.function(seed=self.options.seed, **self.options.kwargs)
        if not isinstance(produced, Iterable):
            raise MilesUserError(
                f"data.function {self.options.function!r} returned "
                f"{type(produced).__name__}, not an iterable of prompt records"
            )
        return iter(produced)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        key = self.options.prompt_key
        bad_in_a_row = 0
        for record in itertools.islice(self._stream(), self.consumed, None):
            self.consumed += 1
            if usable(record, key):
                bad_in_a_row = 0
                yield dict(record)
                continue
            where = f"record {self.consumed}"
            if self.options.on_bad_row == "error":
                raise MilesUserError(
                    f"data.function {self.options.function!r} {where}: not a dict with {key!r} "
                    f"(got {record!r:.200})"
                )
            self.skipped += 1
            bad_in_a_row += 1
            if not self._warned:
                self._warned = True
                warn_skipped(f"data.function {self.options.function!r}", 1, where, key)
            if bad_in_a_row >= self.options.max_bad_in_a_row:
                raise MilesUserError(
                    f"data.function {self.options.function!r}: {bad_in_a_row} malformed records "
                    f"in a row (the last is {where}); a record must be a dict with {key!r}"
                )

    def state_dict(self) -> dict[str, Any]:
        """Records consumed so far (and skipped), saved in checkpoints."""
        return {"consumed": self.consumed, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved number of records."""
        self.consumed = int(state["consumed"])
        self.skipped = int(state.get("skipped", 0))


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
    register(
        DataSource(
            name="parquet",
            factory=ParquetSource,
            config=ParquetOptions,
            description="prompt records from a Parquet file (needs the datasets library)",
        )
    )
    register(
        DataSource(
            name="generator",
            factory=GeneratorSource,
            config=GeneratorOptions,
            description="prompt records yielded by a Python function 'module:function'",
        )
    )
