"""Where families cache what they extract from model files: ``~/.cache/miles/families``
(``$MILES_CACHE_DIR/families`` when set)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """The families cache folder."""
    base = os.environ.get("MILES_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "miles"
    return root / "families"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so concurrent readers never see a
    partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
