"""The removal of the shared memory a trainer actor's process left (:mod:`miles_ray.shm`):
only files named after the given pids, only once that process has exited, never a file a live
process still maps; and on a real Ray cluster, the colocated run's files are gone after it."""

from __future__ import annotations

import mmap
import subprocess
import sys
import time
from pathlib import Path

from miles_ray.shm import remove_left


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make(root: Path, pid: int, n: int) -> Path:
    path = root / f"torch_{pid}_{1000 + n}_{n}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_only_the_files_of_exited_processes_that_nobody_maps_are_removed(tmp_path: Path) -> None:
    dead, other_dead = _exited_pid(), _exited_pid()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = [_make(tmp_path, dead, i) for i in range(3)]
        mapped = _make(tmp_path, dead, 7)
        kept = [
            _make(tmp_path, running.pid, 1),  # its process still runs
            _make(tmp_path, other_dead, 1),  # a pid not asked about
            tmp_path / f"torch_{dead}0_1_1",  # another pid that starts with the same digits
            tmp_path / "unrelated",
        ]
        for path in kept[2:]:
            path.write_bytes(b"x")
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as view:
            t0 = time.monotonic()
            counts = remove_left([dead, running.pid], timeout_s=1.0, root=str(tmp_path))
            waited = time.monotonic() - t0
            assert mapped.exists()  # this process maps it: kept
            view[0] = 1
        assert counts == {"removed": 3, "kept": 2}
        assert waited >= 1.0  # it waited for the running process and the mapping
        assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
        # unmapped now, and nothing of the running process is asked about: gone at once
        t0 = time.monotonic()
        assert remove_left([dead], timeout_s=30.0, root=str(tmp_path)) == {"removed": 1, "kept": 0}
        assert time.monotonic() - t0 < 5 and not mapped.exists()
    finally:
        running.kill()
        running.wait()
    # nothing to remove: no wait at all
    t0 = time.monotonic()
    assert remove_left([running.pid], timeout_s=30.0, root=str(tmp_path)) == {
        "removed": 1,
        "kept": 0,
    }
    assert remove_left([12345678], timeout_s=30.0, root=str(tmp_path)) == {"removed": 0, "kept": 0}
    assert time.monotonic() - t0 < 5
