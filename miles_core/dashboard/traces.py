"""An index of a run's ``traces.jsonl`` (one JSON line per traced sample, written a step at a
time by the run's traces): which byte ranges of the file hold each traced step, read
incrementally from where the previous read stopped.

Only the index is kept, never the lines: a step's lines are read from the file when that step
is asked for, at most :data:`MAX_STEP_BYTES` of them. A step's lines are contiguous; a run that
resumed may append a step again, and then the later block is the one that counted: a block
starts where the step changes, or where a ``(group, sample)`` of the block being read comes
again. The newest :data:`MAX_STEPS` steps are indexed; older ones are forgotten.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

#: the file's name in the run's folder (the one ``miles_core.runtime.traces`` writes)
TRACES_FILE = "traces.jsonl"
#: the most traced steps indexed (the newest ones)
MAX_STEPS = 1000
#: the most steps one answer lists (the newest ones)
MAX_LISTED_STEPS = 200
#: the most bytes of a step's lines one answer reads and returns (``truncated`` past it)
MAX_STEP_BYTES = 4 << 20
#: the bytes one read of the file takes (more for a longer line, up to :data:`MAX_LINE_BYTES`)
MAX_BYTES_PER_READ = 1 << 20
#: the most bytes one refresh indexes (a long file is indexed over several refreshes)
MAX_REFRESH_BYTES = 64 << 20
#: the longest line indexed (a longer one is counted as malformed and skipped)
MAX_LINE_BYTES = MAX_STEP_BYTES


def _reject_constant(name: str) -> Any:
    # NaN and infinities are not JSON: a page's JSON.parse would refuse the whole answer
    raise ValueError(f"{name} is not JSON")


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A trace line as a dict, or ``None`` when it is not a JSON object with an integer
    ``step``."""
    try:
        data = json.loads(line, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError):  # JSONDecodeError is a ValueError
        return None
    if not isinstance(data, dict):
        return None
    step = data.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return data


class TracesIndex:
    """Step -> byte ranges of that step's newest block of lines in a growing ``traces.jsonl``.

    Read like the metrics: a line counts once its newline is written, a line that is not a JSON
    object with an integer ``step`` (or longer than :data:`MAX_LINE_BYTES`) is skipped and
    counted in :attr:`malformed`, and a file that shrank or was replaced is indexed again from
    its start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.malformed = 0
        self.resets = 0
        #: step -> [start, end) byte ranges of its newest block (adjacent ranges merged)
        self.steps: dict[int, list[tuple[int, int]]] = {}
        self._inode: tuple[int, int] | None = None
        self._skipping = False  # inside a line longer than a read: skipped to its newline
        self._block_step: int | None = None  # the step of the block being read
        self._block_keys: set[tuple[Any, Any]] = set()
        self._lock = threading.Lock()

    def _reset(self) -> None:
        self.offset, self.malformed, self.steps = 0, 0, {}
        self._skipping, self._block_step, self._block_keys = False, None, set()

    def _refresh(self, fh: IO[bytes]) -> None:
        """Index what was appended since the last refresh, from the open file ``fh``."""
        st = os.fstat(fh.fileno())
        size, inode = st.st_size, (st.st_dev, st.st_ino)
        if size < self.offset or inode != self._inode:  # a new file in its place
            if self._inode is not None:
                self.resets += 1
            self._reset()
            self._inode = inode
        budget, want = MAX_REFRESH_BYTES, MAX_BYTES_PER_READ
        while self.offset < size and budget > 0:
            fh.seek(self.offset)
            chunk = fh.read(min(size - self.offset, want))
            budget -= len(chunk)
            if self._consume(chunk):
                want = MAX_BYTES_PER_READ
            elif len(chunk) < size - self.offset and want <= MAX_LINE_BYTES:
                want = MAX_LINE_BYTES + 1  # a line longer than a read: read it whole
            else:
                return  # a line being written: read on the next refresh

    def _consume(self, chunk: bytes) -> bool:
        """Index the whole lines of ``chunk`` (read at :attr:`offset`); returns whether the
        offset moved."""
        start = 0
        if self._skipping:  # the rest of an overlong line
            end = chunk.find(b"\n")
            if end < 0:
                self.offset += len(chunk)
                return True
            self._skipping, start = False, end + 1
        last = chunk.rfind(b"\n")
        if last < start:
            if len(chunk) - start > MAX_LINE_BYTES:  # skipped up to its newline
                self.malformed += 1
                self._skipping = True
                self.offset += len(chunk)
                return True
            self.offset += start
            return start > 0
        pos = start
        while pos <= last:
            end = chunk.index(b"\n", pos)
            line = chunk[pos:end]
            if line.strip():
                self._index(line, self.offset + pos, self.offset + end + 1)
            pos = end + 1
        self.offset += last + 1
        return True

    def _index(self, line: bytes, start: int, end: int) -> None:
        data = parse_line(line) if len(line) <= MAX_LINE_BYTES else None
        if data is None:
            self.malformed += 1
            return
        step = data["step"]
        key = (data.get("group"), data.get("sample"))
        ranges = self.steps.get(step)
        if step != self._block_step or key in self._block_keys or ranges is None:
            # a new block of this step: it replaces an earlier one (a resumed run's)
            self._block_step, self._block_keys = step, set()
            self.steps.pop(step, None)
            self.steps[step] = ranges = []
            if len(self.steps) > MAX_STEPS:
                del self.steps[min(self.steps)]
        self._block_keys.add(key)
        if step not in self.steps:  # this very step was the oldest, and forgotten
            return
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))

    def _open(self) -> IO[bytes] | None:
        try:
            return self.path.open("rb")
        except FileNotFoundError:
            with self._lock:
                self._reset()
                self._inode = None
            return None

    def listing(self) -> dict[str, Any]:
        """``{"exists", "steps", "malformed"}`` after a refresh: the newest
        :data:`MAX_LISTED_STEPS` traced steps, ascending."""
        fh = self._open()
        if fh is None:
            return {"exists": False, "steps": [], "malformed": 0}
        with fh, self._lock:
            self._refresh(fh)
            return self._listing()

    def _listing(self) -> dict[str, Any]:
        steps = sorted(self.steps)[-MAX_LISTED_STEPS:]
        return {"exists": True, "steps": steps, "malformed": self.malformed}

    def step(self, step: int) -> dict[str, Any] | None:
        """The listing with ``"step"`` and its ``"lines"`` (the newest block's, at most
        :data:`MAX_STEP_BYTES` of them: ``truncated`` says whether some were left out) after a
        refresh; ``None`` when ``step`` is not traced."""
        fh = self._open()
        if fh is None:
            return None
        with fh, self._lock:
            self._refresh(fh)
            ranges = self.steps.get(step)
            if ranges is None:
                return None
            lines, truncated = _read_lines(fh, ranges, step)
            return {**self._listing(), "step": step, "lines": lines, "truncated": truncated}


def _read_lines(
    fh: IO[bytes], ranges: list[tuple[int, int]], step: int
) -> tuple[list[dict[str, Any]], bool]:
    """The lines of step ``step`` in ``ranges`` of ``fh``, at most :data:`MAX_STEP_BYTES`
    read, and whether some were left out."""
    lines: list[dict[str, Any]] = []
    left = MAX_STEP_BYTES
    for start, end in ranges:
        fh.seek(start)
        data = fh.read(min(end - start, left))
        left -= len(data)
        cut = len(data) < end - start
        if cut:  # whole lines only
            data = data[: data.rfind(b"\n") + 1]
        for raw in data.split(b"\n"):
            parsed = parse_line(raw) if raw.strip() else None
            if parsed is not None and parsed["step"] == step:
                lines.append(parsed)
        if cut:
            return lines, True
    return lines, False
