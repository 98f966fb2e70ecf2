"""Shared helpers of the terminal environment's tests: what is left running on the machine."""

from __future__ import annotations

import os
import time

import pytest
from miles_env_terminal.sandbox import Sandbox, SandboxLimits, SandboxUnavailable


def sandbox_or_skip(limits: SandboxLimits | None = None) -> Sandbox:
    """A sandbox, or a skip naming the property this machine cannot isolate (the refusal
    itself is tested on every machine, in test_terminal_sandbox.py)."""
    try:
        return Sandbox(limits)
    except SandboxUnavailable as exc:
        pytest.skip(f"host: this machine cannot isolate the sandbox: {exc}")


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int) -> list[int]:
    """Live (non-zombie aside) descendants of ``root`` read from /proc."""
    parents = _parents()
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found.extend(kids)
        frontier.extend(kids)
    return found


#: the dedicated uids the sandboxes of this test process took (recorded by the conftest): the
#: tests of another pytest-xdist worker run sandboxes of other uids meanwhile, whose processes
#: are not this one's leftovers
OWN_UIDS: set[int] = set()


def processes_of_uids(uids: set[int]) -> list[int]:
    """PIDs whose owner uid is one of ``uids`` (sandboxes' dedicated uids)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in uids:
                    found.append(int(entry))
            except OSError:
                pass
    return found


#: clock ticks since boot when the current test started (set by the conftest): processes of
#: this test process started before it (another plugin's session-scoped engine server, when
#: the whole repository's tests run in one process) are not this test's leftovers
_SINCE = [0]


def _now_ticks() -> int:
    with open("/proc/uptime") as fh:
        return int(float(fh.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def mark_test_start() -> None:
    """Remember when this test started (see :func:`assert_nothing_left`)."""
    _SINCE[0] = _now_ticks()


def _started_since(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[19]) >= _SINCE[0]


def assert_nothing_left() -> None:
    """No process this test started, and none of the uid of a sandbox of this process, is
    alive."""
    deadline = time.monotonic() + 2.0
    while True:
        mine = [p for p in descendants(os.getpid()) if _started_since(p)]
        left = mine + processes_of_uids(OWN_UIDS)
        # a reader thread's pipe may close a moment after the jail exits
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    details = []
    for pid in left:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ")[:200]
            details.append(f"{pid}: {cmdline!r}")
        except OSError:
            pass
    assert not details, f"processes left running: {details}"
