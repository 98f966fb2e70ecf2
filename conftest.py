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


#: seconds each test file took in a recorded run (``scripts/test_durations.py`` writes it)
_DURATIONS = os.path.join(os.path.dirname(__file__), "tests", "durations.json")
#: a test of a file without a record: rough seconds by marker
_COST = {"memory_heavy": 120.0, "slow": 25.0}
#: a memory-heavy file goes to every this-many-th place in the queue
_HEAVY_EVERY = 4


def _file_cost(path: str, items: list[pytest.Item], recorded: dict[str, float]) -> float:
    if path in recorded:
        return recorded[path]
    return sum(
        next((c for m, c in _COST.items() if i.get_closest_marker(m) is not None), 0.5)
        for i in items
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files in the order their runs should start (the test command has xdist keep it,
    ``--no-loadscope-reorder``): the longest first, so the run ends on short files and no
    worker is left alone with a long one; and the memory-heavy ones spread through the queue, so
    a worker seldom waits on another's (they take one lock). Tests within a file keep their
    order."""
    import json

    try:
        with open(_DURATIONS) as f:
            recorded = {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        recorded = {}
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    cost = {f: _file_cost(f, its, recorded) for f, its in files.items()}
    ranked = sorted(files, key=lambda f: -cost[f])  # stable: ties keep their order
    heavy = [f for f in ranked if any(i.get_closest_marker("memory_heavy") for i in files[f])]
    rest = [f for f in ranked if f not in heavy]
    order: list[str] = []
    while heavy or rest:
        if heavy and (len(order) % _HEAVY_EVERY == 0 or not rest):
            order.append(heavy.pop(0))
        else:
            order.append(rest.pop(0))
    items[:] = [i for f in order for i in files[f]]


@pytest.fixture(autouse=True)
def _torch_grad_mode_restored() -> Iterator[None]:
    """Every test runs in one process: one that leaves torch's grad mode off makes later
    trainer tests fail far from the cause. Such a test errors here, and the mode is restored.
    The number of torch threads a test sets is put back after it (a bitwise comparison with a
    server that runs one thread depends on it)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
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
