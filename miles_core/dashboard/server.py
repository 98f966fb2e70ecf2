"""The dashboard's HTTP server: JSON endpoints over a run folder's files and one static page.

Endpoints (all ``GET``):

- ``/``: the page (``static/index.html``) and ``/static/dashboard.js``, its script;
- ``/health``: ``{"ok": true}``;
- ``/api/metrics?since=N&limit=M``: the rows of ``metrics.jsonl`` from index ``N`` (at most
  ``M``, capped), with ``next`` (the ``since`` of the next request), ``total``, ``malformed``
  (lines skipped) and ``exists``;
- ``/api/ledger``: ``ledger.json`` and the newest step's ``ledger/...`` counts;
- ``/api/run``: the run section of ``run.json``'s config and the main parts' names;
- ``/api/traces``: the traced steps of ``traces.jsonl`` (the newest, ascending), ``malformed``
  (lines skipped) and ``exists``; ``/api/traces?step=N``: the same with that step's ``lines``
  (its newest block, at most 4 MiB of them: ``truncated``), 404 when it is not traced.

It binds loopback by default. Beyond loopback it requires the run's API key
(``MILES_API_KEY``): the ``/api/`` routes then answer 401 without ``Authorization: Bearer
<key>``. The page and its script carry no run data and are served without it; the page reads
the key from its URL's fragment (``#key=...``, which a browser never sends to a server) and
sends it with each request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from miles_core.dashboard.reader import MAX_ROWS_PER_REQUEST, RunFiles
from miles_core.errors import MilesUserError
from miles_core.hosts import API_KEY_ENV, api_key, bearer_matches, is_loopback

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: ``app[FILES]``: the run folder's files the endpoints read
FILES: web.AppKey[RunFiles] = web.AppKey("files", RunFiles)

#: the static files of the page, by URL path: (package file, content type)
STATIC = {
    "/": ("index.html", "text/html"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript"),
}


class BindRefused(MilesUserError):
    """The dashboard was asked to listen beyond loopback without the run's API key."""


def check_bind(host: str, key: str | None) -> None:
    """Raise :class:`BindRefused` when ``host`` is not loopback and there is no API key: the
    run's metrics and config would be readable by anyone reaching the port."""
    if not is_loopback(host) and not key:
        raise BindRefused(
            f"--host {host!r}: refusing to serve the dashboard beyond loopback without an API "
            f"key. Set {API_KEY_ENV} (the page then takes it as #key=<key> in its URL, other "
            "clients send `Authorization: Bearer <key>`), or bind a loopback address such as "
            "127.0.0.1"
        )


def _key_middleware(key: str) -> Any:

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/api/"):
            return await handler(request)
        if not bearer_matches(request.headers.get("Authorization"), key):
            return web.json_response(
                {
                    "error": f"{request.path} requires the run's API key: send "
                    f"`Authorization: Bearer <key>` with the key the dashboard was started "
                    f"with ({API_KEY_ENV}); the page takes it as #key=<key> in its URL"
                },
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="miles"'},
            )
        return await handler(request)

    return require_key


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        message = f"query parameter {name!r}: an integer from {low} to {high} (got {raw[:40]!r})"
        raise web.HTTPBadRequest(
            text=json.dumps({"error": message}), content_type="application/json"
        )
    return value


async def _metrics(request: web.Request) -> web.Response:
    since = _int_param(request, "since", 0, 0, 1 << 62)
    limit = _int_param(request, "limit", MAX_ROWS_PER_REQUEST, 1, MAX_ROWS_PER_REQUEST)
    files = request.app[FILES]
    # file reads off the event loop: a slow disk does not hold the other requests
    page = await asyncio.to_thread(files.metrics.page, since, limit)
    return web.json_response(page)


async def _ledger(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(request.app[FILES].ledger_counts))


async def _run(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(request.app[FILES].run))


async def _traces(request: web.Request) -> web.Response:
    index = request.app[FILES].traces
    if "step" not in request.query:
        return web.json_response(await asyncio.to_thread(index.listing))
    step = _int_param(request, "step", 0, 0, 1 << 62)
    answer = await asyncio.to_thread(index.step, step)
    if answer is None:
        message = (
            f"step {step} is not traced in {index.path.name} (see /api/traces for those that are)"
        )
        return web.json_response({"error": message, "step": step}, status=404)
    return web.json_response(answer)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _static(name: str, content_type: str) -> Handler:
    body = resources.files("miles_core.dashboard").joinpath("static", name).read_bytes()

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    return serve


def build_app(
    run_dir: Path, *, key: str | None, metrics_file: str = "metrics.jsonl"
) -> web.Application:
    """The aiohttp application of the dashboard of ``run_dir``; with ``key``, its ``/api/``
    routes require it."""
    app = web.Application(middlewares=[_key_middleware(key)] if key else [])
    app[FILES] = RunFiles(run_dir, metrics_file)
    for path, (name, content_type) in STATIC.items():
        app.router.add_get(path, _static(name, content_type))
    app.router.add_get("/health", _health)
    app.router.add_get("/api/metrics", _metrics)
    app.router.add_get("/api/ledger", _ledger)
    app.router.add_get("/api/run", _run)
    app.router.add_get("/api/traces", _traces)
    return app


class Dashboard:
    """The dashboard of one run folder, served from a thread of its own (its own event loop),
    so a training run or a command line can start it beside its work.

    ``start()`` binds (``port`` 0: a free port) and returns the URL; ``stop()`` closes it.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_file: str = "metrics.jsonl",
    ) -> None:
        self.key = api_key()
        check_bind(host, self.key)
        if not 0 <= port <= 65535:
            raise MilesUserError(f"port {port}: a port number from 0 (any free one) to 65535")
        self.run_dir, self.host, self.port = Path(run_dir), host, port
        self.metrics_file = metrics_file
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="miles-dashboard", daemon=True
        )
        self._runner: web.AppRunner | None = None

    def start(self) -> str:
        """Bind and serve; returns the page's URL."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            self.port = future.result(timeout=30)
        except OSError as exc:
            self.stop()
            raise MilesUserError(
                f"dashboard: cannot listen on {self.host}:{self.port}: {exc}"
            ) from None
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/"
        return self.url

    async def _start(self) -> int:
        app = build_app(self.run_dir, key=self.key, metrics_file=self.metrics_file)
        # its answers are small and quick: stopping waits for one in progress a second at most
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        # bound here, so that port 0 gives the free port it took
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        await web.SockSite(self._runner, sock).start()
        return int(sock.getsockname()[1])

    def stop(self) -> None:
        """Close the server and its thread."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout=30)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metrics_file_of(config: Any) -> str:
    """The file a run config's ``jsonl`` metric sink writes in the run folder (its default,
    ``metrics.jsonl``, when the run selects none)."""
    from miles_core.builtins.metric_sinks import JsonlSinkOptions

    for sink in config.metrics.sinks:
        if isinstance(sink.options, JsonlSinkOptions):  # the options of the jsonl sink
            return str(sink.options.filename)
    return "metrics.jsonl"
