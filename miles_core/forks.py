"""Worker processes forked from a process that imported their heavy modules once.

A process started from nothing (``spawn``, ``python -m ...``) spends seconds of CPU importing
torch and transformers before it does anything: on a 2-core machine, about 7 s for a trainer
rank or an engine server, most of what a short-lived one costs. Two ways around it:

- :func:`preloaded`: the ``forkserver`` context of :mod:`multiprocessing` whose server imports
  the modules named, for :mod:`multiprocessing` processes (a trainer's ranks). The server is
  one per process, started at its first use with the modules named up to then (``__main__``
  and those of the first caller); a later caller's other modules are imported by its processes
  after the fork. It keeps the environment of its start: a process takes its starter's with
  :func:`adopt_environment` first thing.
- :class:`ForkedServer`: ``python -m module ARGS`` as a fork of a small server process of this
  process that imported ``module`` (one per module), answering as a :class:`subprocess.Popen`.
  That server is itself a process of the :func:`preloaded` fork server (``module`` among the
  modules it imports when it starts there first), so an engine's servers and a trainer's ranks
  started by one process share one import of torch and transformers: the second to start
  imports only its own modules.

For CPU workers only: where a worker will use CUDA, start it from nothing (an import that asks
the driver anything, even the device count, would leave the forks a CUDA they cannot use).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from typing import Any, ClassVar

__all__ = ["ForkServerError", "ForkedServer", "adopt_environment", "preloaded"]


def preloaded(modules: Iterable[str]) -> ForkServerContext:
    """The ``forkserver`` context, whose server imports ``modules`` (dotted names) when it
    starts (if it has not yet started)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *sorted(set(modules))])
    return ctx


def adopt_environment(environ: Mapping[str, str]) -> None:
    """Make ``environ`` (the starter's ``os.environ`` when it started this process) this
    process's environment."""
    os.environ.clear()
    os.environ.update(environ)


class ForkServerError(RuntimeError):
    """The fork server could not import its module, or is gone."""


# --- the fork server's side ---------------------------------------------------------------------


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request: dict[str, Any]) -> int:
    """The body of a forked server: its own session, stdin from /dev/null, stdout and stderr
    to the log, the starter's environment and command line; the exit code of ``main``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The title takes the place of the fork server's command line and environment (before the
    # environment changes); SPT_NOENV (Ray's workers set it) would leave it the command line's
    # room alone, where `python -m MODULE` does not fit.
    os.environ.pop("SPT_NOENV", None)
    try:
        import setproctitle
    except ImportError:  # the command line stays the fork server's
        pass
    else:
        setproctitle.setproctitle(" ".join(request["title"]))
    adopt_environment(request["env"])
    sys.argv = list(request["title"][2:])  # as `python -m module ARGS` has it
    try:
        importlib.import_module(request["module"]).main(request["argv"])
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _serve_forks() -> None:
    """The fork server: takes the starter's environment and imports the modules named on its
    first line of stdin (``{"env": {...}, "modules": [...]}``), says ``{"ready": true}``, then
    forks one server a line (``{"pid": P, "fork": N}``: forks are numbered, as a pid may be
    another's later), says each fork's end (``{"exit": N, "code": C}``), and exits when its
    stdin closes (the forks go on)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pending = b""
    first = True
    forks: dict[int, int] = {}  # pid -> number, of the forks not yet reaped
    number = 0
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        while True:  # reap first: a pid reported ended is never a live fork's
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in forks:
                _say({"exit": forks.pop(pid), "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            message = json.loads(line)
            if first:
                first = False
                try:
                    _take_environment(message["env"])
                    for module in message["modules"]:
                        importlib.import_module(module)
                except BaseException:
                    _say({"error": traceback.format_exc()})
                    return
                _say({"ready": True})
                continue
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(message)
                finally:
                    for stream in (sys.stdout, sys.stderr):
                        try:
                            stream.flush()
                        except Exception:
                            pass
                    os._exit(code)
            number += 1
            forks[pid] = number
            _say({"pid": pid, "fork": number})


def _take_environment(environ: Mapping[str, str]) -> None:
    """Take ``environ`` (the starter's, now) as a process started now would: as this process's
    environment, with the folders of its ``PYTHONPATH`` that the path lacks put first."""
    adopt_environment(environ)
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra


def _serve_on(requests: Any, answers: Any, module: str) -> None:
    """A fork server of ``module`` as a process of the :mod:`multiprocessing` fork server:
    ``requests`` and ``answers`` (the read and write ends of two pipes) become its stdin and
    stdout."""
    for end, fd in ((requests, 0), (answers, 1)):
        os.dup2(end.fileno(), fd)
        end.close()
    # setproctitle finds the room for a title at its first title, in the environment of this
    # process's start laid out after its command line (which _take_environment moves): so
    # here, before it (SPT_NOENV, which Ray's workers set, would leave that room alone).
    os.environ.pop("SPT_NOENV", None)
    try:
        import setproctitle
    except ImportError:  # titles stay this process's command line
        pass
    else:
        setproctitle.setproctitle(f"miles fork server of {module}")
    _serve_forks()


# --- the starter's side -------------------------------------------------------------------------


class _Server:
    """A running fork server of this process, and what it said of its forks."""

    _running: ClassVar[dict[tuple[int, str], _Server]] = {}
    _starting = threading.Lock()

    @classmethod
    def of(cls, module: str) -> _Server:
        """This process's fork server of ``module`` (started, and ``module`` imported, at the
        first call)."""
        key = (os.getpid(), module)
        with cls._starting:
            server = cls._running.get(key)
            if server is None or not server.running():
                server = cls._running[key] = cls(module)
            return server

    def __init__(self, module: str) -> None:
        self.module = module
        # A process of the multiprocessing fork server, whose imports (``module``'s when it
        # starts for this one) the trainer's ranks share; it ignores a Ctrl-C (its forks are in
        # sessions of their own) and ends when this process closes its stdin or ends.
        ctx = preloaded([module])
        requests, self._requests = ctx.Pipe(duplex=False)
        self._answers, answers = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_serve_on,
            args=(requests, answers, module),
            name=f"miles-forks-{module}",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            requests.close()
            answers.close()
        #: the exit code of each fork that ended, by its number
        self.exits: dict[int, int] = {}
        self._pending = b""
        self._lock = threading.Lock()
        self._send({"env": dict(os.environ), "modules": [module]})
        answer = self._next(lambda m: "ready" in m or "error" in m)
        if "error" in answer:
            raise ForkServerError(f"the fork server could not import {module}:\n{answer['error']}")

    def running(self) -> bool:
        """Whether the server process has not ended."""
        return self.process.exitcode is None

    def _send(self, message: Any) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._requests.fileno(), data) :]
        except OSError as exc:
            raise ForkServerError(f"the fork server of {self.module} is gone: {exc}") from None

    def _read(self, timeout: float) -> bool:
        """Take in what the server said within ``timeout`` s; False once it is gone."""
        fd = self._answers.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self._pending += chunk
        return True

    def _messages(self) -> Iterable[dict[str, Any]]:
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            message: dict[str, Any] = json.loads(line)
            if "exit" in message:
                self.exits[int(message["exit"])] = int(message["code"])
            else:
                yield message

    def _next(self, wanted: Any) -> dict[str, Any]:
        """The next message ``wanted`` accepts (end reports are kept on the way)."""
        while True:
            for message in self._messages():
                if wanted(message):
                    return message
            if not self._read(1.0):
                self.process.join(5.0)
                raise ForkServerError(
                    f"the fork server of {self.module} ended (exit code {self.process.exitcode})"
                )

    def fork(self, request: dict[str, Any]) -> tuple[int, int]:
        """Fork one server; its pid and its number."""
        with self._lock:
            self._send(request)
            answer = self._next(lambda m: "pid" in m)
            return int(answer["pid"]), int(answer["fork"])

    def code(self, number: int, pid: int) -> int | None:
        """The exit code of fork ``number`` (``pid``) if it ended, else None (without
        waiting)."""
        with self._lock:
            if number not in self.exits:
                alive = self._read(0.0)
                list(self._messages())
                if not alive and number not in self.exits and not _exists(pid):
                    self.exits[number] = 1  # ended after its server: the code is lost
            return self.exits.get(number)


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


class ForkedServer:
    """``python -m module *argv`` as a fork of this process's fork server of ``module``, which
    imported it once: ``module.main(argv)`` runs in a session of its own, with stdin from
    ``/dev/null``, stdout and stderr appended to ``log_path``, the environment this process has
    now, and that command line as its title (``ps``, ``/proc/PID/cmdline``, where
    ``setproctitle`` is installed). It answers as the :class:`subprocess.Popen` of the command
    would: ``pid``, ``poll()``, ``wait(timeout)``, ``returncode`` (``-N`` after signal N; 1 if it
    ended after its fork server, whose exit code is then lost), ``terminate()``, ``kill()``.

    The fork server lives as long as this process; the forks live on after both, as a
    ``Popen`` child does."""

    def __init__(self, module: str, argv: Sequence[str], log_path: str) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self._server = _Server.of(module)
        request = {
            "module": module,
            "argv": list(argv),
            "log": log_path,
            "env": dict(os.environ),
            "title": self.args,
        }
        self.pid, self._number = self._server.fork(request)
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        """The exit code once the process ended, else None."""
        if self._code is None:
            self._code = self._server.code(self._number, self.pid)
        return self._code

    def poll(self) -> int | None:
        """:attr:`returncode`, without waiting."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the process ended; :class:`subprocess.TimeoutExpired` after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig``, unless the process has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM, unless the process has ended."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, unless the process has ended."""
        self.send_signal(signal.SIGKILL)
