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
        pytest.skip(f"this machine cannot isolate the sandbox: {exc}")


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


def processes_of_uids(lo: int, hi: int) -> list[int]:
    """PIDs whose owner uid is in ``[lo, hi)`` (the sandbox's dedicated uids)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if lo <= os.stat(f"/proc/{entry}").st_uid < hi:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def assert_nothing_left(uid_base: int = 61000) -> None:
    """No process started by this test process, and none of a sandbox uid, is alive."""
    deadline = time.monotonic() + 2.0
    while True:
        left = descendants(os.getpid()) + processes_of_uids(uid_base, uid_base + 4096)
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
