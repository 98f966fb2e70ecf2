"""``sglang-router`` as a Miles router: started, supervised and stopped as a subprocess.

The router (``python -m sglang_router.launch_router``, a Rust server) forwards SGLang-native
``/generate`` requests to the engines it knows and returns each engine's answer unchanged.
Engines are added and removed at run time through its control API: ``GET /workers`` lists them
(``id``, ``url``, ``is_healthy``), ``POST /workers`` with ``{"url": ...}`` queues an addition,
``DELETE /workers/{id}`` a removal; both are asynchronous (202), so :meth:`SglangRouter.set_engines`
waits until the listing shows exactly the requested engines. ``GET /liveness`` answers while
the router serves; ``GET /readiness`` reports ``healthy_workers``.

The router binds its node's address (``host``, default :func:`miles_core.hosts.node_address`).
With the run's API key (``MILES_API_KEY``) it is started with ``--api-key``: it then requires
the key on every endpoint but ``/liveness`` and sends it to the engines, so a client of the
router sends the key as to an engine; the control calls here send it too, and an engine added
at run time is given it. Without a key it may bind only a loopback address.

Everything here is blocking and uses only the standard library: a fleet calls it at start, at
the end, and when an engine leaves or comes back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from miles_core.hosts import API_KEY_ENV, api_key, resolve_host
from miles_engine_client.binding import check_bind, url_host
from miles_engine_client.plugin import SglangRouterOptions

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: How long one control request to the router may take.
_CONTROL_TIMEOUT_S = 5.0
#: What a router says in its log when its listening or metrics port is taken.
_PORT_TAKEN = "Address already in use"
#: Control calls go straight to the router, never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RouterError(RuntimeError):
    """The router failed: it did not start, died, or did not apply an engine change in time."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _normalize(url: str) -> str:
    return url.rstrip("/")


def _http(
    base_url: str, key: str | None, method: str, path: str, body: Any, *, timeout: float
) -> tuple[int, Any]:
    """One request to the router at ``base_url`` with the API key ``key``: the status and the
    parsed answer. A 401 is a :class:`RouterError` naming the key to set."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    if status == 401:
        raise RouterError(
            f"the router at {base_url} refused {method} {path} with 401: it requires an API key "
            f"this process does not send; set {API_KEY_ENV} to the key it was started with"
        )
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


class SglangRouter:
    """A ``sglang-router`` process routing generation over a set of engines
    (:class:`miles_core.contracts.Router`).

    ``start(engines)`` launches it in a session of its own, with its output in a log file
    (:attr:`log_path`), and returns its base URL once it serves and reports every engine
    healthy. ``set_engines`` changes the engines through the router's API. ``alive()`` is true
    while the process runs and answers ``/liveness``. ``stop()`` sends SIGTERM to its process
    group, then SIGKILL after ``shutdown_grace_s`` plus a margin.
    """

    def __init__(self, options: SglangRouterOptions | None = None) -> None:
        self.options = options or SglangRouterOptions()
        #: the address the router binds, resolved at each start where it runs (this process's
        #: node: a placement that joins a cluster may set it after the router is made)
        self.host = resolve_host(self.options.host)
        #: the run's API key, as this process has it when the router is made
        self.api_key = api_key()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: str | None = None
        self.url: str | None = None
        self.engines: list[str] = []

    # --- the contract ------------------------------------------------------------------------

    def start(self, engines: Sequence[str]) -> str:
        """Start the router over ``engines`` (base URLs); returns the router's base URL.

        Raises :class:`RouterError` with the tail of the router's log when it exits, or does not
        serve every engine within ``startup_timeout_s``."""
        if self.process is not None and self.process.poll() is None:
            raise RouterError(f"the router is already running at {self.url}")
        wanted = self._check_engines(engines)
        self.host = resolve_host(self.options.host)
        try:
            check_bind(self.host, "router 'sglang'")
        except ValueError as exc:
            raise RouterError(str(exc)) from None
        if importlib.util.find_spec("sglang_router") is None:
            raise RouterError(
                "router 'sglang' needs the sglang-router package: pip install sglang-router==0.3.2"
            )
        o = self.options
        # A port picked here can be taken by someone else before the router binds it; only
        # then, and only for ports this class picked, is another pair tried.
        attempts = 3 if o.port is None or o.metrics_port is None else 1
        for attempt in range(attempts):
            port = o.port or _free_port(self.host)
            metrics_port = o.metrics_port or _free_port(self.host)
            self._launch(wanted, port, metrics_port)
            try:
                self._wait_serving(wanted, time.monotonic() + o.startup_timeout_s)
            except RouterError:
                taken = _PORT_TAKEN in self.log_tail()
                self.stop()
                if taken and attempt + 1 < attempts:
                    continue
                raise
            self.engines = wanted
            assert self.url is not None
            return self.url
        raise AssertionError("unreachable")

    def set_engines(self, engines: Sequence[str]) -> None:
        """Route over exactly ``engines`` from now on; returns once the router lists exactly
        them, all healthy. Requests already forwarded to a removed engine finish there. With no
        engine (all are restarting), the router answers every request at once with an error.

        An engine the router lists but holds unhealthy (its own probe failed, e.g. while the
        engine restarted) is removed and added again, so it serves at once instead of after
        the router's next successful probes."""
        wanted = self._check_engines(engines, allow_none=True)
        self._require_running()
        deadline = time.monotonic() + self.options.startup_timeout_s
        listed = {w["url"]: w for w in self._workers()}
        drop = {u: w for u, w in listed.items() if u not in wanted or not w.get("is_healthy")}
        for worker in drop.values():
            self._control("DELETE", f"/workers/{urllib.parse.quote(str(worker['id']))}")
        # Removal is asynchronous, and adding a URL the router still lists fails.
        self._wait(lambda ws: not set(drop) & {w["url"] for w in ws}, deadline, "remove", drop)
        for url in wanted:
            if url not in listed or url in drop:
                # the engine's key: without it the router reaches a keyed engine's generation
                # (its own key) but not its /model_info
                added = {"url": url}
                if self.api_key is not None:
                    added["api_key"] = self.api_key
                self._control("POST", "/workers", added)
        self._wait_engines(wanted, deadline)
        self.engines = wanted

    def alive(self) -> bool:
        """Whether the router process runs and answers ``/liveness``."""
        if self.process is None or self.process.poll() is not None or self.url is None:
            return False
        try:
            status, _ = self._http("GET", "/liveness", timeout=2.0)
        except OSError:
            return False
        return status == 200

    def stop(self) -> None:
        """Stop the router: SIGTERM to its process group, SIGKILL if it is still there after
        ``shutdown_grace_s`` + 5 s. Idempotent."""
        proc, self.process = self.process, None
        self.url = None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.options.shutdown_grace_s + 5)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait(timeout=10)

    # --- introspection ----------------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        """The router's own view of its engines (``GET /workers``): ``url``, ``id``,
        ``is_healthy``, ``load``..."""
        self._require_running()
        return self._workers()

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the router's log, without terminal colours."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return _ANSI.sub("", f.read())[-n:]
        except OSError:
            return ""

    def command(self, engines: Sequence[str], port: int, metrics_port: int) -> list[str]:
        """The router's command line (with ``--api-key`` when the run has a key: the router
        then requires it, and sends it to the engines)."""
        o = self.options
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--worker-urls", *engines,
            "--host", self.host,
            "--port", str(port),
            "--policy", o.policy,
            "--prometheus-host", self.host,
            "--prometheus-port", str(metrics_port),
            "--request-timeout-secs", str(o.request_timeout_s),
            "--health-check-interval-secs", str(o.health_check_interval_s),
            "--shutdown-grace-period-secs", str(o.shutdown_grace_s),
            # An engine being added is probed again after this many seconds (default 30).
            "--worker-startup-check-interval", "1",
            "--worker-startup-timeout-secs", str(max(1, int(o.startup_timeout_s))),
            "--log-level", o.log_level,
        ]  # fmt: skip
        if o.max_retries == 0:
            cmd.append("--disable-retries")
        else:
            cmd += ["--retry-max-retries", str(o.max_retries)]
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        return cmd

    # --- internals --------------------------------------------------------------------------

    def _check_engines(self, engines: Sequence[str], *, allow_none: bool = False) -> list[str]:
        if isinstance(engines, str):
            raise TypeError("engines must be a sequence of base URLs, not one string")
        wanted = [_normalize(u) for u in engines]
        if not wanted and not allow_none:
            raise RouterError("router 'sglang' needs at least one engine URL")
        bad = [u for u in wanted if urllib.parse.urlparse(u).scheme not in ("http", "https")]
        if bad:
            raise RouterError(f"router 'sglang': engine URLs must be http(s)://host:port: {bad}")
        if len(set(wanted)) != len(wanted):
            raise RouterError(f"router 'sglang': an engine is listed twice in {wanted}")
        return wanted

    def _launch(self, engines: list[str], port: int, metrics_port: int) -> None:
        o = self.options
        if o.log_dir is not None:
            os.makedirs(o.log_dir, exist_ok=True)
        fd, self.log_path = tempfile.mkstemp(
            prefix="miles-sglang-router-", suffix=".log", dir=o.log_dir
        )
        with os.fdopen(fd, "wb") as log_file:
            # A session of its own: stop() signals the router's whole process group, never
            # the caller's, and a Ctrl-C meant for the trainer does not reach it first.
            self.process = subprocess.Popen(
                self.command(engines, port, metrics_port),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.url = f"http://{url_host(self.host)}:{port}"

    def _wait_serving(self, engines: list[str], deadline: float) -> None:
        while True:
            self._require_running()
            try:
                status, _ = self._http("GET", "/liveness", timeout=2.0)
            except OSError:
                status = 0
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise RouterError(
                    f"the router at {self.url} did not answer within "
                    f"{self.options.startup_timeout_s}s; its log ({self.log_path}) ends with:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)
        self._wait_engines(engines, deadline)

    def _wait_engines(self, engines: list[str], deadline: float) -> None:
        wanted = set(engines)

        def done(workers: list[dict[str, Any]]) -> bool:
            listed = {w["url"] for w in workers}
            healthy = {w["url"] for w in workers if w.get("is_healthy")}
            return listed == wanted and healthy == wanted

        self._wait(done, deadline, "route over exactly", sorted(wanted))

    def _wait(
        self,
        done: Callable[[list[dict[str, Any]]], bool],
        deadline: float,
        what: str,
        engines: Any,
    ) -> None:
        while True:
            self._require_running()
            workers = self._workers()
            if done(workers):
                return
            if time.monotonic() > deadline:
                state = {w["url"]: bool(w.get("is_healthy")) for w in workers}
                raise RouterError(
                    f"the router at {self.url} did not {what} {sorted(engines)} within "
                    f"{self.options.startup_timeout_s}s (it lists url -> healthy: {state}); "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _workers(self) -> list[dict[str, Any]]:
        body = self._control("GET", "/workers")
        if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
            raise RouterError(f"unexpected answer of the router's GET /workers: {body!r}")
        return [dict(w, url=_normalize(str(w.get("url", "")))) for w in body["workers"]]

    def _require_running(self) -> None:
        if self.process is None:
            raise RouterError("the router is not running: call start() first")
        code = self.process.poll()
        if code is not None:
            raise RouterError(
                f"the router exited with {code}; its log ({self.log_path}) ends with:\n"
                f"{self.log_tail()}"
            )

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        try:
            status, answer = self._http(method, path, body, timeout=_CONTROL_TIMEOUT_S)
        except OSError as exc:
            # A router that was killed refuses connections a moment before it can be reaped:
            # give it that moment, so the error says it exited rather than "no answer".
            if self.process is not None:
                try:
                    self.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            self._require_running()
            raise RouterError(
                f"the router at {self.url} did not answer {method} {path}: {exc}"
            ) from exc
        if status >= 300:
            raise RouterError(f"the router answered {method} {path} with {status}: {answer}")
        return answer

    def _http(self, method: str, path: str, body: Any = None, *, timeout: float) -> tuple[int, Any]:
        assert self.url is not None
        return _http(self.url, self.api_key, method, path, body, timeout=timeout)

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
