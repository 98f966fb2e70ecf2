"""Repo-wide pytest hooks.

With ``MILES_STRICT_SKIPS=1`` (set by ``scripts/test.sh``, so in CI) a skipped test fails unless
its reason says it needs a GPU, or starts with ``host:`` and names a facility of the operating
system that no install step provides (a kernel feature, root, a second network address). CI runs
on a fresh CPU machine with every plugin installed, so a test that skips there for any other
reason (a missing package, a missing file) is a test that silently stopped running.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Generator, Iterator
from typing import Any

import pytest

#: The only reasons a test may skip in CI: hardware the CPU machine does not have, or a facility
#: of the host's operating system (reason starting with "host:").
ALLOWED_SKIP = re.compile(r"\b(CUDA|GPUs?|NVIDIA)\b|^host:", re.IGNORECASE)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    reason = (
        str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    )
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if os.environ.get("MILES_STRICT_SKIPS") != "1" or not report.skipped:
        return
    if hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if ALLOWED_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped on the CI machine: {reason}\n"
        "MILES_STRICT_SKIPS=1: only a test that needs a GPU, or a facility of the host's "
        "operating system (reason 'host: ...'), may skip; install what it needs in "
        "scripts/bootstrap.sh or make it run on CPU"
    )


@pytest.fixture(autouse=True)
def _torch_grad_mode_restored() -> Iterator[None]:
    """Every test runs in one process: one that leaves torch's grad mode off makes later
    trainer tests fail far from the cause. Such a test errors here, and the mode is restored."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("this test left torch's grad mode off: use `with torch.no_grad():`")


@pytest.fixture(autouse=True)
def _one_memory_heavy_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``memory_heavy`` (whole runs with several engines and trainers, or a real
    model's) take a lock shared by the run's xdist workers, so two never overlap: together
    they would exceed the CI machine's memory, one at a time they fit beside the rest."""
    if request.node.get_closest_marker("memory_heavy") is None:
        yield
        return
    import fcntl
    import tempfile
    import time

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = os.path.join(tempfile.gettempdir(), f"miles-memory-heavy-{run}.lock")
    with open(path, "a") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"waited {waited:.0f} s for another memory-heavy test to end")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
