"""The run's orphan guard: when the process running the loop is killed with SIGKILL, the guard
stops what it started in sessions of their own (engine servers); when the run ends normally,
the guard exits and touches nothing. Real processes, real signals (Linux: it reads /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="host: needs /proc")

# A stand-in for `miles train`: starts the guard, then a child in its own session (as the
# engine launcher does), prints the pids, and waits to be killed or told to finish.
PARENT = """
import subprocess, sys, time
from miles_core.runtime.guard import OrphanGuard

guard = OrphanGuard.start()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                         stdout=subprocess.PIPE, text=True)
print(guard.process.pid, child.pid, child.stdout.readline().strip(), flush=True)
if sys.stdin.readline().strip() == "finish":
    guard.stop()
    print("stopped", flush=True)
    time.sleep(300)
"""


def _running(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return data[data.rindex(")") + 2] not in "ZX"  # a zombie has exited


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


SLEEPER = "print('up', flush=True); import time; time.sleep(300)"

# A child that holds a bucket buffer of the colocated transport in shared memory, as a trainer
# does: torch starts its shared-memory manager as the child's own child.
HOLDER = """
import time
from miles_transport_common.payload import serialize, shared_cpu_buffer

buf = shared_cpu_buffer(1 << 20)
serialize(buf)
print(buf.untyped_storage()._share_filename_cpu_()[1].decode(), flush=True)
time.sleep(300)
"""


def _start(child_source: str = SLEEPER) -> tuple[subprocess.Popen[str], int, int, str]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, child_source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    guard, child, said = parent.stdout.readline().split()
    time.sleep(1.5)  # the guard records the tree every half second
    return parent, int(guard), int(child), said


def test_a_killed_run_leaves_no_process_behind():
    parent, guard, child, _ = _start()
    try:
        assert _running(child) and _running(guard)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left = _wait_gone([child, guard], 20)
    finally:
        for pid in (child, guard):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the kill: {left}"


def test_a_run_that_ends_normally_keeps_its_guard_out_of_the_way():
    parent, guard, child, _ = _start()
    try:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write("finish\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "stopped"
        assert not _wait_gone([guard], 10)  # the guard has exited...
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        time.sleep(1.0)
        assert _running(child)  # ...and what it watched is no longer its business
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="host: no /dev/shm")
def test_a_killed_run_leaves_no_shared_memory_behind():
    """The guard stops torch's shared-memory manager with the rest of the tree, so it removes
    the shared memory those processes made itself: without that, a killed trainer's buckets
    stay in /dev/shm (memory) until the machine restarts."""
    pytest.importorskip("miles_transport_common")
    parent, guard, child, name = _start(HOLDER)
    shm = Path("/dev/shm" + name)
    try:
        assert shm.is_file()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left = _wait_gone([child, guard], 20)
    finally:
        for pid in (child, guard):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the kill: {left}"
    assert not shm.exists(), f"{shm} is still there"
