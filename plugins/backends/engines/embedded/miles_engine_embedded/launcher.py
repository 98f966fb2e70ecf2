"""Starts embedded engine servers as subprocesses (the :class:`EngineLauncher` contract)."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_engine_client.binding import check_bind, url_host

from miles_core.forks import ForkedServer
from miles_core.hosts import resolve_host
from miles_engine_embedded.plugin import EmbeddedEngineConfig

if TYPE_CHECKING:
    from miles_engine_embedded.client import EmbeddedClient


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it before it is used:
    servers the launcher starts bind port 0 themselves, see :func:`bind_listening`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_listening(host: str, port: int, port_file: str | None) -> socket.socket:
    """The server side of the launcher's port handshake: a socket bound to ``(host, port)``
    (``port`` 0: one the kernel picks, so no other process can take it between the pick and
    the bind) and, with ``port_file``, the bound port written to that file atomically.

    Raises :class:`~miles_engine_client.binding.BindRefused` before binding an address beyond
    loopback without the run's API key (``MILES_API_KEY``)."""
    check_bind(host, "an engine server")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(sock.getsockname()[1]))
        os.replace(tmp, port_file)
    return sock


def read_port(port_file: str) -> int | None:
    """The port a server wrote with :func:`bind_listening`, or None while it has not."""
    try:
        with open(port_file) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text else None


class EngineStartError(RuntimeError):
    """The server process died or did not answer ``/health`` in time."""


class EmbeddedLauncher:
    """Launches ``python -m miles_engine_embedded.server`` processes and stops them.

    A server on the CPU is a fork of this process's fork server
    (:class:`miles_core.forks.ForkedServer`), which imported the server's module, torch and
    transformers once: started from nothing, each server spent about 7 s of CPU importing them
    (an engine replaced after a failure, or one more in a run, starts that much sooner). A
    server on CUDA, or in an engine actor (see :meth:`forks`), is started as that command."""

    #: the module the servers run (``python -m``); its ``main(argv)`` serves
    server_module = "miles_engine_embedded.server"

    def __init__(self, options: EmbeddedEngineConfig) -> None:
        self.options = options
        self.num_engines = options.num_engines
        self.processes: dict[int, subprocess.Popen[bytes] | ForkedServer] = {}
        self.logs: dict[int, str] = {}
        self.urls: dict[int, str] = {}
        #: the temp folder of the logs when no ``log_dir`` is given (made at the first launch;
        #: removed once the last log in it is)
        self._temp_logs: str | None = None
        #: engines whose logs are kept: each died or failed to start at least once
        self._keep_logs: set[int] = set()
        #: servers may be forks of this process's fork server (:meth:`forks`); an engine actor
        #: turns it off: its one server is its child, which Ray stops with the actor
        self.fork = True
        #: called with each server's pid as soon as it is spawned, before it answers (a
        #: supervisor that must outlive a failed start watches it from then on)
        self.on_spawn: Callable[[int], None] = lambda pid: None

    def forks(self) -> bool:
        """Whether servers are forked rather than started as their command: on the CPU, unless
        :attr:`fork` was turned off."""
        return self.fork and self.options.device == "cpu"

    def command(self, model_path: str, port: int) -> list[str]:
        """The server command line for ``model_path`` on ``port``."""
        return [sys.executable, "-m", self.server_module, *self.server_args(model_path, port)]

    def server_args(self, model_path: str, port: int) -> list[str]:
        """The arguments of :attr:`server_module` for ``model_path`` on ``port``."""
        o = self.options
        cmd = [
            "--model-path", model_path,
            "--host", resolve_host(o.host),
            "--port", str(port),
            "--device", o.device,
            "--dtype", o.dtype,
            "--max-running-requests", str(o.max_running_requests),
            "--seed", str(o.seed),
            "--weight-version", o.weight_version,
            "--log-level", o.log_level,
            "--dist-timeout", str(o.dist_timeout),
            "--max-weights-body-mb", str(o.max_weights_body_mb),
        ]  # fmt: skip
        if o.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(o.max_total_tokens)]
        if o.context_length is not None:
            cmd += ["--context-length", str(o.context_length)]
        if not o.lean_forward:
            cmd.append("--no-lean-forward")
        if o.matmul != "auto":
            cmd += ["--matmul", o.matmul]
        if o.attention != "auto":
            cmd += ["--attention", o.attention]
        if o.true_on_policy:
            cmd.append("--true-on-policy")
        if o.allow_nonfinite_weights:
            cmd.append("--allow-nonfinite-weights")
        if o.num_threads is not None:
            cmd += ["--num-threads", str(o.num_threads)]
        if o.enable_lora or o.lora_paths:
            cmd += [
                "--enable-lora",
                "--max-lora-rank", str(o.max_lora_rank),
                "--max-loras-per-batch", str(o.max_loras_per_batch),
            ]  # fmt: skip
            if o.max_loaded_loras is not None:
                cmd += ["--max-loaded-loras", str(o.max_loaded_loras)]
            if o.lora_paths:
                cmd += ["--lora-paths", *o.lora_paths]
            if o.lora_target_modules:
                cmd += ["--lora-target-modules", *o.lora_target_modules]
        return cmd

    def launch(self, model_path: str, *, index: int) -> str:
        """Start engine ``index`` serving ``model_path``; returns its base URL once
        ``/health`` answers. Raises :class:`EngineStartError` with the log tail otherwise."""
        if index in self.processes and self.processes[index].poll() is None:
            raise EngineStartError(f"engine {index} is already running at {self.urls[index]}")
        o = self.options
        # the node's address when no host is given, read here: on the node the server runs on
        host = url_host(resolve_host(o.host))
        log_path = self._log_path(index)
        argv = self.server_args(model_path, o.port + index if o.port is not None else 0)
        port_file = None
        if o.port is None:
            # The server binds port 0 and writes the port it got: a port picked here and bound
            # there could be taken in between by any other process on the host.
            port_file = log_path[: -len(".log")] + ".port"
            if os.path.exists(port_file):  # a start before this one that died before reading it
                os.unlink(port_file)
            argv += ["--port-file", port_file]
        # Own session: a supervisor can kill the engine's whole process group without touching
        # the trainer's.
        proc: subprocess.Popen[bytes] | ForkedServer
        if self.forks():
            proc = ForkedServer(self.server_module, argv, log_path)
        else:
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", self.server_module, *argv],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self.processes[index], self.logs[index] = proc, log_path
        self.on_spawn(proc.pid)
        port = o.port + index if o.port is not None else None
        deadline = time.monotonic() + o.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._keep_logs.add(index)
                raise EngineStartError(
                    f"engine {index} exited with {proc.returncode} (log {log_path}):\n"
                    f"{self.log_tail(index)}"
                )
            if port is None:
                port = read_port(port_file)  # type: ignore[arg-type]
                if port is None:
                    time.sleep(0.1)
                    continue
                os.unlink(port_file)  # type: ignore[arg-type]
            url = f"http://{host}:{port}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.urls[index] = url
                        return url
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        self._keep_logs.add(index)
        self.stop(index)
        raise EngineStartError(
            f"engine {index} did not answer /health within {o.startup_timeout_s}s "
            f"(log {log_path}):\n{self.log_tail(index)}"
        )

    def _log_path(self, index: int) -> str:
        """Engine ``index``'s log: ``engine-<index>.log`` in ``log_dir``, or in this launcher's
        temp folder (made here at the first launch)."""
        if self.options.log_dir is not None:
            folder = self.options.log_dir
            os.makedirs(folder, exist_ok=True)
        else:
            if self._temp_logs is None:
                self._temp_logs = tempfile.mkdtemp(prefix="miles-embedded-")
            folder = self._temp_logs
        return os.path.join(folder, f"engine-{index}.log")

    def client(self, url: str, *, timeout_s: float | None = None) -> EmbeddedClient:
        """An :class:`~miles_engine_embedded.client.EmbeddedClient` for the server at ``url``
        (SGLang's client and the embedded engine's extensions)."""
        from miles_engine_embedded.client import EmbeddedClient

        return EmbeddedClient(url, timeout_s=timeout_s)

    def log_tail(self, index: int, n: int = 4000) -> str:
        """The last ``n`` characters of engine ``index``'s log."""
        try:
            with open(self.logs[index], errors="replace") as f:
                return f.read()[-n:]
        except (KeyError, OSError):
            return ""

    def stop(self, index: int) -> None:
        """Terminate engine ``index`` (SIGTERM, then SIGKILL after 10 s). In the temp folder
        of the logs, its log goes with it, unless it died or failed to start (the log is kept
        for whoever reads why)."""
        proc = self.processes.pop(index, None)
        self.urls.pop(index, None)
        if proc is None:
            return
        if proc.poll() is not None:
            self._keep_logs.add(index)
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        self._drop_log(index)

    def _drop_log(self, index: int) -> None:
        """Remove engine ``index``'s log from the temp folder of the logs (and the folder once
        empty), unless it is kept."""
        folder = self._temp_logs
        if folder is None or index in self._keep_logs:
            return
        log = self.logs.pop(index, None)
        if log is not None and os.path.dirname(log) == folder:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(log)
        if not os.listdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
            self._temp_logs = None

    def shutdown(self) -> None:
        """Stop every engine this launcher started."""
        for index in list(self.processes):
            self.stop(index)


def build(options: EmbeddedEngineConfig | None, *, true_on_policy: bool = False) -> Any:
    """Factory registered with Miles: ``factory(options) -> EngineLauncher``; a run with
    ``rollout.true_on_policy`` calls ``factory(options, true_on_policy=True)``."""
    options = options or EmbeddedEngineConfig()
    if true_on_policy and not options.true_on_policy:
        options = options.model_copy(update={"true_on_policy": True})
    if options.launch_in == "ray_actor":
        from miles_engine_embedded.ray_launcher import RayEmbeddedLauncher

        return RayEmbeddedLauncher(options)
    return EmbeddedLauncher(options or EmbeddedEngineConfig())
