"""Incremental reads of a run folder's own files: ``metrics.jsonl`` (from the byte offset the
previous read stopped at), ``ledger.json``, ``run.json`` and the index of ``traces.jsonl``
(:mod:`miles_core.dashboard.traces`).

The dashboard keeps no record of its own: every value it serves comes from these files, as the
run wrote them. A row is kept with the keys the page draws only (:data:`KEPT_PREFIXES`), so a
long run's rows stay small in memory and on the wire.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from miles_core.dashboard.traces import TRACES_FILE, TracesIndex

#: the keys of a metrics row the dashboard keeps: those the page draws and tabulates
KEPT_PREFIXES = (
    "reward/",
    "eval/",
    "time/",
    "trainer/",
    "rollout/",
    "buffer/",
    "staleness/",
    "drops/",
    "ledger/",
    "engine/",
    "admission/",
    "sinks/",
)
#: keys kept whole
KEPT_KEYS = frozenset({"step", "time", "weight_version", "samples_per_s"})

#: the most rows one request returns; the page asks again from where the answer stopped
MAX_ROWS_PER_REQUEST = 2000
#: the most bytes of ``metrics.jsonl`` one refresh reads (a later refresh reads on)
MAX_BYTES_PER_READ = 8 << 20
#: the longest line kept (a longer one is counted as malformed and skipped)
MAX_LINE_BYTES = 1 << 20


def _kept(key: str) -> bool:
    return key in KEPT_KEYS or key.startswith(KEPT_PREFIXES)


def _row(line: bytes) -> dict[str, float] | None:
    """A metrics row from one line: its numeric dashboard keys, or ``None`` when the line is
    not a JSON object with an integer ``step``."""
    try:
        data = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        return None
    row: dict[str, float] = {
        k: float(v)
        for k, v in data.items()
        if _kept(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    row["step"] = data["step"]  # kept an integer: the page labels its axes with it
    return row


class MetricsTail:
    """The rows of a growing ``metrics.jsonl``, read from where the last read stopped.

    A line counts once it ends with a newline (the sink writes and flushes whole lines; a line
    being written is read on the next refresh). A line that is not a JSON object with an integer
    ``step`` is skipped and counted in :attr:`malformed`. A file that shrank or was replaced (an
    earlier run moved aside) is read again from its start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rows: list[dict[str, float]] = []
        self.malformed = 0
        self.resets = 0
        self._inode: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Read what was appended since the last refresh (up to :data:`MAX_BYTES_PER_READ`);
        returns whether the file exists."""
        with self._lock:
            try:
                with self.path.open("rb") as fh:
                    st = os.fstat(fh.fileno())
                    size, inode = st.st_size, (st.st_dev, st.st_ino)
                    # a new file in its place (an earlier run moved aside): start over
                    if size < self.offset or inode != self._inode:
                        if self._inode is not None:
                            self.resets += 1
                        self.offset, self.rows, self.malformed = 0, [], 0
                        self._inode = inode
                    fh.seek(self.offset)
                    chunk = fh.read(min(size - self.offset, MAX_BYTES_PER_READ))
            except FileNotFoundError:
                return False
            self._consume(chunk)
            return True

    def _consume(self, chunk: bytes) -> None:
        end = chunk.rfind(b"\n")
        if end < 0:
            if len(chunk) >= MAX_BYTES_PER_READ:  # one line longer than a read: skip it
                self.offset += len(chunk)
                self.malformed += 1
            return
        for line in chunk[:end].split(b"\n"):
            if not line.strip():
                continue
            row = _row(line) if len(line) <= MAX_LINE_BYTES else None
            if row is None:
                self.malformed += 1
            else:
                self.rows.append(row)
        self.offset += end + 1

    def page(self, since: int, limit: int) -> dict[str, Any]:
        """Rows ``since`` onwards (indices into every row read so far), at most ``limit``
        (capped at :data:`MAX_ROWS_PER_REQUEST`), after a refresh."""
        exists = self.refresh()
        limit = max(1, min(limit, MAX_ROWS_PER_REQUEST))
        with self._lock:
            since = max(0, min(since, len(self.rows)))
            rows = self.rows[since : since + limit]
            return {
                "exists": exists,
                "rows": rows,
                "since": since,
                "next": since + len(rows),
                "total": len(self.rows),
                "more": since + len(rows) < len(self.rows),
                "malformed": self.malformed,
                "resets": self.resets,
                "offset": self.offset,
            }

    def latest_with(self, key: str) -> dict[str, float] | None:
        """The newest row that has ``key``, after a refresh; ``None`` when none has."""
        self.refresh()
        with self._lock:
            return next((r for r in reversed(self.rows) if key in r), None)


class JsonFile:
    """A small JSON file of the run (``ledger.json``, ``run.json``), parsed again only when its
    modification time or size changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._value: Any = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def read(self) -> dict[str, Any]:
        """``{"exists", "value", "error"}``: the parsed content, or why there is none."""
        with self._lock:
            try:
                st = self.path.stat()
            except FileNotFoundError:
                self._stamp = None
                return {"exists": False, "value": None, "error": None}
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._value, self._error = json.loads(self.path.read_bytes()), None
                except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                    # a file being rewritten: the next poll reads it whole
                    self._value, self._error, self._stamp = None, str(exc), None
            return {"exists": True, "value": self._value, "error": self._error}


def run_summary(record: Any) -> dict[str, Any]:
    """What the page shows of ``run.json``: the run section of its config and its versions."""
    if not isinstance(record, dict):
        return {}
    config = record.get("config")
    run = config.get("run") if isinstance(config, dict) else None
    out: dict[str, Any] = {"run": run if isinstance(run, dict) else {}}
    for section in ("backend", "engine", "algorithm", "transport"):
        value = config.get(section) if isinstance(config, dict) else None
        name = value.get("name") if isinstance(value, dict) else value
        if isinstance(name, str):
            out[section] = name
    dists = record.get("distributions")
    if isinstance(dists, dict):
        out["miles_core"] = dists.get("miles-core")
    return out


class RunFiles:
    """The files of one run folder the dashboard reads."""

    def __init__(self, run_dir: Path, metrics_file: str = "metrics.jsonl") -> None:
        self.run_dir = run_dir
        self.metrics = MetricsTail(run_dir / metrics_file)
        self.ledger = JsonFile(run_dir / "ledger.json")
        self.record = JsonFile(run_dir / "run.json")
        self.traces = TracesIndex(run_dir / TRACES_FILE)

    def run(self) -> dict[str, Any]:
        """The ``/api/run`` answer."""
        got = self.record.read()
        return {
            "run_dir": str(self.run_dir),
            "exists": got["exists"],
            "error": got["error"],
            "summary": run_summary(got["value"]),
        }

    def ledger_counts(self) -> dict[str, Any]:
        """The ``/api/ledger`` answer: ``ledger.json`` (written when the run ends) and the
        ledger counts of the newest step's row (``ledger/...``), which the run writes every
        step."""
        got = self.ledger.read()
        latest = self.metrics.latest_with("ledger/produced")
        counts = {
            k[len("ledger/") :]: v for k, v in (latest or {}).items() if k.startswith("ledger/")
        }
        value = got["value"] if isinstance(got["value"], dict) else None
        return {
            "exists": got["exists"],
            "error": got["error"],
            "file": value,
            "step": latest["step"] if latest else None,
            "latest": counts,
        }
