"""What a loopback Ray cluster needs from this machine: ports that no other cluster claimed and
no process uses (a registry beside the system's temporary folder: a lock file and a JSON list
of the claimed blocks), the processes of a session (read from ``/proc``; Linux), and a
watchdog that ends a cluster whose owner ended without stopping it."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the claimed blocks lie in [PORT_FLOOR, PORT_CEILING): above a default Ray cluster's worker
#: ports (10002-19999), below Linux's ephemeral ports (32768 and up), which the kernel hands
#: to outgoing connections
PORT_FLOOR = 20000
PORT_CEILING = 32768
#: ports per node: 16 fixed (see NodePorts), the rest for the node's worker processes
NODE_PORTS = 128
#: a unix socket path longer than this is refused by the kernel; Ray's plasma socket is
#: <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store
SOCKET_PATH_LIMIT = 107

_REGISTRY = "miles-loopback-ray-ports"


class ClusterStartError(RuntimeError):
    """The cluster did not come up: a node exited or was not alive in time (the message holds
    the tail of each node's log)."""


class HostUnfitError(ClusterStartError):
    """This machine lacks what a loopback cluster needs (Linux's ``/proc``, the loopback
    addresses 127.0.0.2 and up); the message starts with ``host:``."""


@dataclass(frozen=True)
class NodePorts:
    """The ports of one node, from ``base``: every port Ray would otherwise choose itself."""

    base: int

    def flags(self, head: bool) -> list[str]:
        """The ``ray start`` flags that set them (``head``: with the head's own ports)."""
        b = self.base
        flags = {
            "--node-manager-port": b,
            "--object-manager-port": b + 1,
            "--dashboard-agent-listen-port": b + 2,
            "--dashboard-agent-grpc-port": b + 3,
            "--runtime-env-agent-port": b + 4,
            "--metrics-export-port": b + 5,
            "--min-worker-port": b + 16,
            "--max-worker-port": b + NODE_PORTS - 1,
        }
        if head:
            flags |= {
                "--port": self.gcs,
                "--ray-client-server-port": b + 7,
                "--dashboard-port": b + 8,
            }
        return [part for name, port in flags.items() for part in (name, str(port))]

    @property
    def gcs(self) -> int:
        """The head's GCS port (the cluster's address)."""
        return self.base + 6


# --- The port registry ------------------------------------------------------------------------


@contextmanager
def _registry() -> Iterator[list[dict[str, Any]]]:
    """The claimed blocks, under an exclusive lock; written back on exit. A block whose
    holders are all gone is dropped."""
    root = Path(tempfile.gettempdir())
    with open(root / f"{_REGISTRY}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = root / f"{_REGISTRY}.json"
        try:
            claims = json.loads(path.read_text()) if path.exists() else []
        except ValueError:  # a file cut short by a crash: the live claims re-register
            claims = []
        claims = [c for c in claims if any(is_running(p) for p in c["holders"])]
        yield claims
        path.write_text(json.dumps(claims))


def _free(port: int) -> bool:
    """Whether nothing listens on or is bound to ``port`` on any address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def claim_ports(count: int) -> int:
    """Claim ``count`` consecutive ports that no other cluster claimed and no process uses;
    the first one. Held by this process until :func:`release_ports` (or its end)."""
    with _registry() as claims:
        starts = list(range(PORT_FLOOR, PORT_CEILING - count + 1, NODE_PORTS))
        random.shuffle(starts)
        for start in starts:
            if any(start < c["stop"] and c["start"] < start + count for c in claims):
                continue
            if all(_free(p) for p in range(start, start + count)):
                claims.append({"start": start, "stop": start + count, "holders": [os.getpid()]})
                return start
    raise ClusterStartError(f"no {count} consecutive free ports in [{PORT_FLOOR}, {PORT_CEILING})")


def claimed_blocks() -> list[tuple[int, int]]:
    """The blocks claimed now (``start``, ``stop``), by any process on this machine."""
    with _registry() as claims:
        return sorted((c["start"], c["stop"]) for c in claims)


def hold_ports(start: int, holders: Sequence[int]) -> None:
    """Add ``holders`` (the nodes' processes) to the claim at ``start``: it stays claimed while
    any of them runs, should this process end without releasing it."""
    with _registry() as claims:
        for claim in claims:
            if claim["start"] == start:
                claim["holders"] = sorted({*claim["holders"], *holders})


def release_ports(start: int) -> None:
    """Drop the claim at ``start``."""
    with _registry() as claims:
        claims[:] = [c for c in claims if c["start"] != start]


# --- Processes --------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and session id (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[3])


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` that have not exited."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and stat[1] == sid:
                found.append(int(entry.name))
    return sorted(found)


def send_signal(pids: Sequence[int], sig: signal.Signals, group: bool = False) -> None:
    """Send ``sig`` to each of ``pids`` (``group``: to each process group of that id); one
    that is gone already is skipped."""
    for pid in pids:
        try:
            if group:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_sessions(sids: Sequence[int], grace_s: float) -> list[int]:
    """End every process of the sessions ``sids`` (each a node's ``ray start``, the leader of
    its session and of its process group): SIGTERM to each leader's process group (Ray's
    orderly shutdown of the node, its workers included), then SIGKILL to whatever of the
    sessions still runs after ``grace_s``. The pids seen in the sessions, in order."""
    seen: list[int] = []

    def record(pids: Sequence[int]) -> list[int]:
        seen.extend(p for p in pids if p not in seen)
        return list(pids)

    record([p for sid in sids for p in session_members(sid)])
    send_signal(sids, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace_s
    while any(session_members(s) for s in sids) and time.monotonic() < deadline:
        time.sleep(0.1)
    record(kill_sessions(sids))
    return seen


def kill_sessions(sids: Sequence[int]) -> list[int]:
    """SIGKILL every process of the sessions ``sids`` at once, then whatever a dying process
    started meanwhile, until none is left; the pids killed, in order."""
    seen: list[int] = []
    for _ in range(50):
        left = [p for s in sids for p in session_members(s)]
        if not left:
            break
        seen.extend(p for p in left if p not in seen)
        send_signal(left, signal.SIGKILL)
        time.sleep(0.1)
    return seen


def watch(sids: Sequence[int], temp_dir: str, grace_s: float) -> None:
    """The watchdog of a cluster, in a process of its own: wait until stdin closes (the
    cluster's owner stopped it, or ended without stopping it), then end whatever still runs
    in the sessions ``sids`` (the head's, the first, last) and remove ``temp_dir``. Each line
    read meanwhile names the session of a node added since (a pid)."""
    sids = list(sids)
    for line in sys.stdin.buffer:
        sids += [int(word) for word in line.split() if word.isdigit()]
    end_sessions(sids[1:], grace_s)
    end_sessions(sids[:1], grace_s)
    shutil.rmtree(temp_dir, ignore_errors=True)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the file at ``path``."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def check_bindable(address: str) -> None:
    """Raise :class:`HostUnfitError` unless a socket can be bound to ``address``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError as e:
            raise HostUnfitError(
                f"host: the loopback address {address} cannot be bound: {e}"
            ) from e


def accepts(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    watch([int(a) for a in sys.argv[3:]], sys.argv[2], float(sys.argv[1]))
