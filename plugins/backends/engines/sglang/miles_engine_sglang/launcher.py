"""Starts SGLang servers as subprocesses and stops them (the :class:`EngineLauncher` contract).

Each server runs in its own process group (SGLang forks scheduler and detokenizer processes),
logs to ``<log_dir>/engine-<i>.log``, and counts as started once ``/health`` answers 200. A
server that exits or stays silent during startup is an :class:`EngineStartError` carrying the
tail of its log, so the reason (out of memory, a bad flag, a missing model) is in the message.
"""

from __future__ import annotations

import atexit
import errno
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.hosts import auth_headers
from miles_engine_sglang.command import (
    base_url,
    build_command,
    build_env,
    engine_host,
    engine_port,
    loggable,
)
from miles_engine_sglang.options import SGLangEngineConfig

if TYPE_CHECKING:
    from miles_engine_client import EngineClient


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineStartError(RuntimeError):
    """A server could not start: its port was taken, it exited, or it did not answer in time."""


def port_is_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` right now (nothing else listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As servers bind (uvicorn included): connections of a previous server on this port
        # linger in TIME_WAIT after it stopped, and must not make a restart look refused.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _get(url: str, timeout: float) -> int | None:
    """HTTP status of ``GET url`` (with the run's API key), or ``None`` when nothing
    answered."""
    try:
        req = urllib.request.Request(url, headers=auth_headers())
        # straight to the server: a proxy from the environment would see the API key
        with _OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


class SGLangLauncher:
    """Launches ``python -m sglang.launch_server`` processes, one per engine index, and stops
    them. Also usable as a context manager; servers still running at interpreter exit are
    stopped too, so a crashed driver does not leave GPU servers behind."""

    def __init__(self, options: SGLangEngineConfig) -> None:
        self.options = options
        self.num_engines = options.num_engines
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.urls: dict[int, str] = {}
        # A temp folder is made only when a server is launched without a log_dir.
        self.log_dir: Path | None = Path(options.log_dir) if options.log_dir else None
        atexit.register(self.shutdown)

    def __enter__(self) -> SGLangLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- EngineLauncher ----------------------------------------------------------------------

    def launch(self, model_path: str, *, index: int) -> str:
        """Start engine ``index`` serving ``model_path``; returns its base URL once ``/health``
        (and ``/health_generate`` when ``wait_health_generate``) answers 200. Raises
        :class:`EngineStartError` with the log tail otherwise; the process is then stopped."""
        old = self.processes.get(index)
        if old is not None and old.poll() is None:
            raise EngineStartError(f"engine {index} is already running at {self.urls.get(index)}")
        self.stop(index)  # forget a previous, dead run of this index
        from miles_engine_client.binding import BindRefused

        o = self.options
        try:
            cmd = build_command(model_path, index, o)
        except BindRefused as exc:
            raise EngineStartError(str(exc)) from None
        env = build_env(index, o)
        port, host = engine_port(index, o), engine_host(o)
        # A server already listening there would answer /health in this one's place.
        if not port_is_free(host, port):
            raise EngineStartError(
                f"engine {index}: port {port} on {host} is already in use; stop what listens "
                "there or choose another port / port_stride"
            )
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="miles-sglang-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"engine-{index}.log"
        with open(log_path, "wb") as log:
            log.write(f"# miles: {shlex.join(loggable(cmd))}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() signals all of SGLang's
            )
        self.processes[index], self.logs[index] = proc, log_path
        url = base_url(index, o)
        deadline = time.monotonic() + o.startup_timeout_s
        endpoints = ["/health"] + (["/health_generate"] if o.wait_health_generate else [])
        while endpoints:
            if proc.poll() is not None:
                code = proc.returncode
                self.stop(index)
                raise EngineStartError(
                    f"engine {index} exited with code {code} during startup "
                    f"(log {log_path}):\n{self.log_tail(index, path=log_path)}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop(index)
                raise EngineStartError(
                    f"engine {index} did not answer {endpoints[0]} at {url} within "
                    f"{o.startup_timeout_s:g}s (log {log_path}):\n"
                    f"{self.log_tail(index, path=log_path)}"
                )
            # /health_generate runs a real generation, so it may take longer than a ping.
            timeout = min(left, 2.0 if endpoints[0] == "/health" else 60.0)
            if _get(url + endpoints[0], timeout=max(timeout, 0.1)) == 200:
                endpoints.pop(0)
                continue
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
        self.urls[index] = url
        return url

    def client(self, url: str) -> EngineClient:
        """A :class:`miles_engine_client.EngineClient` for the server at ``url``."""
        from miles_engine_client import EngineClient

        return EngineClient(url, timeout_s=self.options.request_timeout_s)

    def shutdown(self) -> None:
        """Stop every server this launcher started."""
        for index in list(self.processes):
            self.stop(index)

    # --- the rest ----------------------------------------------------------------------------

    def poll(self, index: int) -> int | None:
        """Exit code of engine ``index``'s process, ``None`` while it runs. Raises ``KeyError``
        for an index that was never launched (or was stopped)."""
        return self.processes[index].poll()

    def log_tail(self, index: int, n: int = 4000, *, path: Path | None = None) -> str:
        """The last ``n`` characters of engine ``index``'s log."""
        try:
            with open(path or self.logs[index], errors="replace") as f:
                return f.read()[-n:]
        except (KeyError, OSError):
            return ""

    def stop(self, index: int) -> None:
        """Stop engine ``index`` and every process of its group: SIGTERM, then SIGKILL for
        whatever is left after ``shutdown_grace_s``."""
        proc = self.processes.pop(index, None)
        self.urls.pop(index, None)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session made the server its group's leader
        _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.options.shutdown_grace_s
        try:
            proc.wait(timeout=self.options.shutdown_grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Children may outlive the leader (or ignore SIGTERM): wait out the grace, then kill.
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal(proc, signal.SIGKILL)
        proc.wait()
        # SIGKILL is delivered asynchronously: return only once the group is gone, so that a
        # caller relaunching on these GPUs finds their memory free.
        gone_by = time.monotonic() + 10.0
        while _group_alive(pgid) and time.monotonic() < gone_by:
            time.sleep(0.02)


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to ``proc``'s process group; to ``proc`` alone when the group cannot be
    signalled (so the server itself never outlives a stop)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.send_signal(sig)


def group_members(pgid: int) -> list[int] | None:
    """Live (not zombie) processes of group ``pgid``, read from ``/proc``; ``None`` where
    there is no ``/proc``."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return None
    members = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as dead: it runs no code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat[stat.rfind(")") + 2] != "Z"


def _group_alive(pgid: int) -> bool:
    members = group_members(pgid)
    if members is not None:
        # A zombie is dead but still counts for kill(); where nothing reaps orphans (some
        # containers) only /proc tells the two apart.
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build(options: SGLangEngineConfig | None) -> SGLangLauncher:
    """Factory registered with Miles: ``factory(options) -> EngineLauncher``."""
    return SGLangLauncher(options or SGLangEngineConfig.model_validate({}))
