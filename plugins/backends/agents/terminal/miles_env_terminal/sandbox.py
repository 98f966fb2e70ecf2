"""A sandboxed shell for one episode: commands run in a fresh scratch directory under time,
memory, process and output limits, with no network and nothing outside the directory
writable (or readable, beyond the system's programs).

Each :meth:`Sandbox.run` starts ``python -m miles_env_terminal.jail`` (see that module for the
mechanisms) and every process the command started is killed when it returns: state carries
from one command to the next only through the scratch directory. A property with no working
mechanism makes :class:`Sandbox` refuse to start (:class:`SandboxUnavailable`) unless the
caller lists it in ``allow_unisolated``; a weaker fallback is logged as a warning.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from miles_env_terminal.cgroups import Cgroup
from miles_env_terminal.jail import REFUSED
from miles_env_terminal.limits import (
    ALL_LAYERS,
    DEFAULT_DEVICES,
    DEFAULT_READABLE,
    PROPERTIES,
    Layer,
    Property,
    SandboxLimits,
)

__all__ = [
    "ALL_LAYERS",
    "DEFAULT_DEVICES",
    "DEFAULT_READABLE",
    "PROPERTIES",
    "Layer",
    "Property",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "classify",
]

log = logging.getLogger("miles_env_terminal")
_libc = ctypes.CDLL(None, use_errno=True)


class SandboxUnavailable(RuntimeError):
    """No mechanism isolates a required property on this machine."""


@dataclass
class RunResult:
    """What one command did.

    ``killed_reason`` says why the sandbox stopped it (``timeout``, ``cpu_time``,
    ``output_limit``, ``network``), ``None`` when it ended on its own; ``violations`` lists
    every limit it ran into, including those that only made a call fail (``outside_dir``,
    ``process_limit``, ``memory``). ``left_running`` counts the processes still running
    ``linger_s`` after the command exited, which were then killed."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    killed_reason: str | None = None
    violations: list[str] = field(default_factory=list)
    truncated: bool = False
    duration_s: float = 0.0
    left_running: int = 0


_NOT_ALLOWED = re.compile(r"Permission denied|Read-only file system|Operation not permitted")
_ABS_PATH = re.compile(r"(?<![\w.])(/[^\s'\"‘’:,)]+)")
_MARKERS = {
    "process_limit": re.compile(
        r"fork: (retry: )?Resource temporarily unavailable|BlockingIOError: \[Errno 11\]|"
        r"can't fork|Cannot fork"
    ),
    "memory": re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|\[Errno 12\]"),
    # the last two: a unix socket refused by seccomp with EAFNOSUPPORT (see seccomp.program)
    "network": re.compile(
        r"Bad system call|Network is unreachable|\[Errno 101\]|Name or service not known|"
        r"Temporary failure in name resolution|Address family not supported|\[Errno 97\]"
    ),
    "cpu_time": re.compile(r"CPU time limit exceeded"),
    # EFBIG past RLIMIT_FSIZE: what a program that ignores SIGXFSZ (Python does) sees
    "disk_limit": re.compile(
        r"No space left on device|File size limit exceeded|File too large|\[Errno (28|27)\]"
    ),
}


def classify(stderr: str, exit_code: int, scratch: str) -> list[str]:
    """The limits a command ran into, read from its exit status and its error messages.

    The kernel's refusals are silent to the outside (an ``EACCES`` is just a failed call), so
    the messages the shell and Python print for them are matched; a command that hides them
    only hides them from the record, it still could not do the thing."""
    found = []
    if exit_code == 128 + signal.SIGSYS:
        found.append("network")
    if exit_code == 128 + signal.SIGXCPU:
        found.append("cpu_time")
    if exit_code == 128 + signal.SIGXFSZ:
        # a write past RLIMIT_FSIZE; a shell that execs its last command prints nothing
        found.append("disk_limit")
    for name, pattern in _MARKERS.items():
        if pattern.search(stderr) and name not in found:
            found.append(name)
    root = os.path.realpath(scratch)
    for line in stderr.splitlines():
        if not _NOT_ALLOWED.search(line):
            continue
        for path in _ABS_PATH.findall(line):
            real = os.path.realpath(path)
            if real != "/dev/null" and not (real == root or real.startswith(root + os.sep)):
                found.append("outside_dir")
                break
        if "outside_dir" in found:
            break
    return found


class _Reader(threading.Thread):
    """Drains one pipe, keeping the first ``cap`` bytes; calls ``on_overflow`` once past it."""

    def __init__(self, stream: IO[bytes], cap: int, on_overflow: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.stream, self.cap, self.on_overflow = stream, cap, on_overflow
        self.data = bytearray()
        self.overflow = False

    def run(self) -> None:
        read = self.stream.read1  # type: ignore[attr-defined]
        while chunk := read(65536):
            room = self.cap - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            if len(chunk) > room and not self.overflow:
                self.overflow = True
                self.on_overflow()


# -I keeps the caller's environment variables and user site out of the jail; the package's
# own folder is put on the path explicitly (it works from an editable or a normal install).
_JAIL_MAIN = (
    f"import sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r}); "
    "from miles_env_terminal.jail import main; main()"
)

_UID_LOCK_DIR = "/run/miles-terminal-uids" if os.path.isdir("/run") else "/tmp/miles-terminal-uids"


def _not_traversable(path: str) -> str | None:
    """The first folder on the way to ``path`` that others cannot traverse, if any."""
    current = os.path.realpath(path)
    while True:
        if not os.stat(current).st_mode & 0o001:
            return current
        if current == "/":
            return None
        current = os.path.dirname(current)


def _uid_in_use(uid: int) -> bool:
    try:
        import pwd

        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    return True
            except OSError:
                pass
    return False


def _allocate_uid(base: int) -> tuple[int, int]:
    """A uid no account and no process uses, held by an exclusive lock for the sandbox's
    life so that concurrent sandboxes never share one (their process counts and the final
    kill-by-uid must not mix)."""
    os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(base, base + 4096):
        fd = os.open(os.path.join(_UID_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if _uid_in_use(uid):
            os.close(fd)
            continue
        return uid, fd
    raise SandboxUnavailable(f"no free dedicated uid in {base}..{base + 4095}")


def _name_kill_reason(result: RunResult, overflowed: bool) -> None:
    """Set why the sandbox stopped the command, if it did, and list it first among the
    violations."""
    exit_code = result.exit_code
    if result.timed_out:
        result.killed_reason = "timeout"
    elif overflowed:
        result.killed_reason = "output_limit"
    elif exit_code == 128 + signal.SIGSYS:
        result.killed_reason = "network"
    elif exit_code == 128 + signal.SIGXCPU or (
        # past the soft limit a process that ignores SIGXCPU gets SIGKILL at the hard one
        exit_code == 128 + signal.SIGKILL and "cpu_time" in result.violations
    ):
        result.killed_reason = "cpu_time"
    reason = result.killed_reason
    if reason and reason not in result.violations:
        result.violations.insert(0, reason)


class Sandbox:
    """A sandboxed shell in a fresh scratch directory for one episode.

    Construction checks the mechanisms by running ``true`` inside: it raises
    :class:`SandboxUnavailable` naming the property no mechanism isolates here (unless
    allowed). ``mechanisms`` then says what isolates each property and ``warnings`` what is
    weaker than it should be. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, base_dir: str | None = None):
        self.limits = limits or SandboxLimits()
        self.root = os.geteuid() == 0
        disabled = set(self.limits.disable_layers)
        self.layers = [layer for layer in ALL_LAYERS if layer not in disabled]
        self._uid_fd: int | None = None
        self.uid: int | None = None
        self.gid: int | None = None
        self._top = tempfile.mkdtemp(prefix="miles-terminal-", dir=base_dir)
        self.scratch = os.path.join(self._top, "work")
        os.mkdir(self.scratch, 0o700)
        if self.root and "uid" in self.layers:
            self.uid, self._uid_fd = _allocate_uid(self.limits.uid_base)
            self.gid = self.uid
            os.chmod(self._top, 0o711)  # the uid must traverse to its directory, not list it
            closed = _not_traversable(os.path.dirname(self._top))
            if closed:
                shutil.rmtree(self._top, ignore_errors=True)
                raise SandboxUnavailable(
                    f"the sandbox's uid cannot reach its directory: {closed} is not "
                    "traversable by others (chmod o+x it, or choose another base_dir)"
                )
            os.chown(self.scratch, self.uid, self.gid)
        self.mechanisms: dict[str, list[str]] = {}
        self.warnings: list[str] = []
        self.closed = False
        self.cgroup: Cgroup | None = None
        self._mounted = False
        try:
            self._setup_root_only()
            self._check()
        except BaseException:
            self.close()
            raise

    def _setup_root_only(self) -> None:
        """The mechanisms that need privilege in this namespace: a cgroup (total memory, a
        hard process count, reliable counters) and a size-bounded tmpfs for the scratch
        directory. Each is optional; its absence is a warning."""
        lim = self.limits
        self._pending_warnings: list[str] = []
        if "cgroup" in self.layers:
            self.cgroup = Cgroup.create(lim.total_memory_mb << 20, lim.max_processes)
            if self.cgroup is None and self.root:
                self._pending_warnings.append(
                    f"no cgroup ({Cgroup.why_not}): memory is bounded per process only "
                    f"({lim.memory_mb} MiB x {lim.max_processes} processes)"
                )
        if self.root and "tmpfs" in self.layers:
            opts = f"size={lim.disk_mb}m,mode=0700"
            if self.uid is not None:
                opts += f",uid={self.uid},gid={self.gid}"
            if _libc.mount(b"tmpfs", self.scratch.encode(), b"tmpfs", 6, opts.encode()) == 0:
                self._mounted = True  # 6 = MS_NOSUID | MS_NODEV
            else:
                err = ctypes.get_errno()
                self._pending_warnings.append(
                    f"no tmpfs for the scratch directory ({os.strerror(err)}): disk use is "
                    f"bounded per file only ({lim.max_file_mb} MiB)"
                )

    def _check(self) -> None:
        status, result = self._launch("true", self.limits.wall_s)
        refused = status.get("refused")
        if refused:
            raise SandboxUnavailable(refused)
        if result.exit_code != 0 or not status.get("applied"):
            raise SandboxUnavailable(
                f"the sandbox could not run a command: exit {result.exit_code}, "
                f"{result.stderr.strip()[:500]} {status}"
            )
        self.mechanisms = status["applied"]
        self.mechanisms["cleanup"] = ["pidns" if "pidns" in status["namespaces"] else "subreaper"]
        if self.uid is not None:
            self.mechanisms["cleanup"].append("kill-by-uid")
        if self.cgroup is not None:
            self.mechanisms["cleanup"].append("cgroup")
        self.mechanisms["disk"] = ["tmpfs"] if self._mounted else ["rlimit-fsize"]
        self.warnings = list(status["warnings"]) + self._pending_warnings
        for prop in self.limits.allow_unisolated:
            if not self.mechanisms.get(prop) or self.mechanisms[prop] == ["landlock-tcp"]:
                self.warnings.append(f"{prop} is NOT isolated (allowed by the caller)")
        for warning in self.warnings:
            log.warning("terminal sandbox: %s", warning)

    def _config(self, command: str, wall_s: float) -> dict[str, Any]:
        lim = self.limits
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.scratch,
            "TMPDIR": self.scratch,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        required = [p for p in PROPERTIES if p not in lim.allow_unisolated]
        return {
            "command": command,
            "scratch": self.scratch,
            "shell": "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh",
            "env": env,
            "wall_s": wall_s,
            "cpu_s": lim.cpu_s,
            "memory_bytes": lim.memory_mb << 20,
            "max_processes": lim.max_processes,
            "linger_s": lim.linger_s,
            "max_file_bytes": lim.max_file_mb << 20,
            "uid": self.uid,
            "gid": self.gid,
            "layers": self.layers,
            "required": required,
            "readable": lim.readable,
            "devices": lim.devices,
            "cgroup_procs": self.cgroup.procs_files() if self.cgroup else [],
        }

    def _launch(self, command: str, wall_s: float) -> tuple[dict[str, Any], RunResult]:
        if self.closed:
            raise RuntimeError("the sandbox is closed")
        before = self.cgroup.counters() if self.cgroup else {}
        start = time.monotonic()
        proc, status_r, readers, overflowed = self._start_jail(command, wall_s)
        self._wait_jail(proc, readers, wall_s)
        with os.fdopen(status_r, "rb") as fh:
            raw = fh.read()
        status: dict[str, Any] = json.loads(raw) if raw else {}
        stdout, stderr = (bytes(r.data).decode("utf-8", "replace") for r in readers)
        if not raw:
            stderr += f"\n[sandbox: the jail failed, exit status {proc.returncode}]"
        exit_code = int(status.get("exit_code", proc.returncode) or 0)
        result = RunResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            timed_out=bool(status.get("timed_out")),
            truncated=overflowed.is_set(),
            duration_s=time.monotonic() - start,
            left_running=int(status.get("left_running", 0) or 0),
        )
        if exit_code != REFUSED or not status.get("refused"):
            result.violations = classify(stderr, exit_code, self.scratch)
        self._cgroup_verdict(result, before)
        _name_kill_reason(result, overflowed.is_set())
        if int(status.get("leftovers_killed", 0) or 0):
            log.debug("terminal sandbox: killed %s leftover processes", status["leftovers_killed"])
        return status, result

    def _start_jail(
        self, command: str, wall_s: float
    ) -> tuple[subprocess.Popen[bytes], int, list[_Reader], threading.Event]:
        """Start the jail process for ``command`` and the readers of its output; returns the
        process, the read end of its status pipe, the readers and the event set when the
        output passed its cap (the jail is then told to stop)."""
        status_r, status_w = os.pipe()
        cfg = json.dumps({**self._config(command, wall_s), "status_fd": status_w})
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _JAIL_MAIN, cfg],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        os.close(status_w)
        overflowed = threading.Event()

        def stop() -> None:
            overflowed.set()
            try:
                proc.send_signal(signal.SIGTERM)
            except OSError:
                pass

        cap = self.limits.max_output_bytes
        assert proc.stdout is not None and proc.stderr is not None
        readers = [_Reader(proc.stdout, cap, stop), _Reader(proc.stderr, cap, stop)]
        for reader in readers:
            reader.start()
        return proc, status_r, readers, overflowed

    @staticmethod
    def _wait_jail(proc: subprocess.Popen[bytes], readers: list[_Reader], wall_s: float) -> None:
        """Wait for the jail to exit and its output to be drained."""
        try:
            proc.wait(timeout=wall_s + 10.0)
        except subprocess.TimeoutExpired:
            # the jail enforces wall_s itself; this is the backstop if it is stuck
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for reader in readers:
            reader.join(timeout=5.0)

    def _cgroup_verdict(self, result: RunResult, before: dict[str, int]) -> None:
        """Kill what is left in the cgroup and add the limits its counters recorded."""
        if self.cgroup is None:
            return
        result.left_running += self.cgroup.kill_all()
        after = self.cgroup.counters()
        # the cgroup's own counters: certain, whatever the command printed
        for key, name in (("memory", "memory"), ("processes", "process_limit")):
            if after[key] > before.get(key, 0) and name not in result.violations:
                result.violations.append(name)

    def run(self, command: str, timeout_s: float | None = None) -> RunResult:
        """Run ``command`` with ``bash -c`` in the scratch directory; every process it started
        is dead when this returns. ``timeout_s`` (at most the sandbox's ``wall_s``) bounds the
        wall-clock time."""
        wall = self.limits.wall_s if timeout_s is None else min(timeout_s, self.limits.wall_s)
        status, result = self._launch(command, wall)
        if status.get("refused"):
            raise SandboxUnavailable(str(status["refused"]))
        return result

    def close(self) -> None:
        """Remove the scratch directory and release the dedicated uid."""
        if self.closed:
            return
        self.closed = True
        if self.cgroup is not None:
            self.cgroup.remove()
        if self._mounted:
            _libc.umount2(self.scratch.encode(), 2)  # MNT_DETACH
        shutil.rmtree(self._top, ignore_errors=True)
        if self._uid_fd is not None:
            os.close(self._uid_fd)
            self._uid_fd = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()
