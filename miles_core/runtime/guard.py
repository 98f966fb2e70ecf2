"""The orphan guard: stops a run's engine servers when the run's process dies unannounced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Run by the guard process with ``python -c``: no import of miles, so it starts fast and small.
_GUARD_SOURCE = r"""
import os, select, signal, sys, time

parent, me = int(sys.argv[1]), os.getpid()


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()  # state, ppid, ...; [19] = start time


# /proc/PID/task/TID/children (Linux 4.2 and later): the walk reads only the tree's processes,
# not every process of the machine, twice a second
walk = os.path.exists(f"/proc/{me}/task/{me}/children")


def children(pid):
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += [(int(kid), None) for kid in f.read().split()]
        except OSError:  # the thread ended
            pass
    return kids


def scan():
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat(name)
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append((int(name), fields[19]))
    return kids


def tree():
    kids = None if walk else scan()
    found, todo = {}, [parent]
    while todo:
        pid = todo.pop()
        for kid, start in children(pid) if kids is None else kids.get(pid, ()):
            if kid != me and kid not in found:
                if start is None:
                    fields = stat(kid)
                    if fields is None:
                        continue
                    start = fields[19]
                found[kid] = start
                todo.append(kid)
    return found


def alive(pid, start):
    fields = stat(pid)
    return fields is not None and fields[19] == start and fields[0] not in (b"Z", b"X")


signal.signal(signal.SIGINT, signal.SIG_IGN)
known, said = {}, b""
while True:
    if select.select([0], [], [], 0.5)[0]:
        chunk = os.read(0, 64)
        said += chunk
        if b"done" in said:
            sys.exit(0)
        if chunk:
            continue
        break  # the pipe closed without "done": the parent is gone
    if os.getppid() != parent:
        break
    found = tree()
    if os.getppid() == parent:  # the parent lived through the scan: the tree is complete
        known = found
for sig in (signal.SIGTERM, signal.SIGKILL):
    left = [pid for pid, start in known.items() if alive(pid, start)]
    for pid in left:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p, known[p]) for p in left):
        time.sleep(0.1)
# torch's shared memory of a process it stopped (/dev/shm/torch_<pid>_...): the manager that
# would have removed it was in the tree too. Only where that pid is now no other process's.


def gone(pid, start):
    fields = stat(pid)
    return fields is None or (fields[19] == start and fields[0] in (b"Z", b"X"))


try:
    names = os.listdir("/dev/shm")
except OSError:
    names = []
for name in names:
    parts = name.split("_")
    if len(parts) == 4 and parts[0] == "torch" and parts[1].isdigit():
        pid = int(parts[1])
        if pid in known and gone(pid, known[pid]):
            try:
                os.unlink("/dev/shm/" + name)
            except OSError:
                pass
"""


class OrphanGuard:
    """A small watchdog process that stops this process's descendants if it dies without
    ending the run (SIGKILL, the OOM killer). Engine servers run in sessions of their own, so
    nothing else would reach them: they would keep their memory and ports forever.

    Every half second the guard records the process tree under its parent (from ``/proc``:
    each process's children, where the kernel lists them, else every process's parent);
    when the parent goes away without :meth:`stop`, it sends SIGTERM, then SIGKILL, to every
    recorded process that still runs (matched by start time, so a reused pid is spared), then
    removes the shared memory torch made in those processes (``/dev/shm/torch_<pid>_...``: its
    manager, stopped with them, would have). Linux only; elsewhere :meth:`start` returns
    ``None``."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls) -> OrphanGuard | None:
        """Start the guard of this process (``None`` where there is no ``/proc``)."""
        if not sys.platform.startswith("linux") or not Path("/proc/self/stat").is_file():
            return None
        process = subprocess.Popen(
            [sys.executable, "-c", _GUARD_SOURCE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal's process group spares it
        )
        return cls(process)

    def stop(self) -> None:
        """The run ended in this process: the guard exits and touches nothing."""
        stdin = self.process.stdin
        try:
            if stdin is not None:
                stdin.write(b"done\n")
                stdin.close()
        except OSError:  # the guard is already gone
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
