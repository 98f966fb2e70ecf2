"""A small synchronous JSON client for the engines' weight-update endpoints.

A transport's sender runs in a worker thread of the driver (or inside a Ray actor) and drives
the engines itself, so it speaks HTTP with the standard library alone: no event loop, no engine
client. Every call is bounded by a timeout and carries the run's API key (``MILES_API_KEY``,
read when the call is made); a failure names the engine, the endpoint and what the server said
(a 401: the key to set).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from miles_core.hosts import API_KEY_ENV, auth_headers
from miles_transport_common.errors import BucketRejected, TransportError, TransportTimeout

T = TypeVar("T")

#: Calls go straight to the engine, never through an HTTP proxy from the environment, which
#: would otherwise see the run's API key.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _message(raw: bytes) -> str:
    text = raw.decode(errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message"):  # SGLang's LoRA endpoints: error_message
            if data.get(key):
                return str(data[key])
    return text[:2000]


def call(
    base_url: str,
    endpoint: str,
    body: Mapping[str, Any] | None,
    *,
    timeout_s: float,
    method: str = "POST",
) -> dict[str, Any]:
    """Send one JSON request to ``base_url + endpoint`` and return the JSON answer.

    Raises :class:`TransportTimeout` when no answer came within ``timeout_s``,
    :class:`BucketRejected` when the server answered ``success: false`` or a 4xx (it refused the
    update: nothing of this call was taken), and :class:`TransportError` when the engine could not
    be reached or failed (5xx), or refused the run's API key (401)."""
    url = base_url.rstrip("/") + endpoint
    data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
    headers = auth_headers()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        msg = _message(exc.read())
        if exc.code == 401:
            sent = "a key it refused" if headers else "no key"
            raise TransportError(
                f"{url} -> HTTP 401: {msg} (the engine requires the run's API key and this "
                f"process sent {sent}: set {API_KEY_ENV} to the key the engine was started with)"
            ) from None
        kind = BucketRejected if 400 <= exc.code < 500 else TransportError
        raise kind(f"{url} -> HTTP {exc.code}: {msg}") from None
    except TimeoutError as exc:
        raise TransportTimeout(
            f"timed out after {timeout_s:g} s waiting for {url}; raise timeout_s if the engine is "
            "just slow, otherwise check that it is alive"
        ) from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            raise TransportTimeout(f"timed out after {timeout_s:g} s waiting for {url}") from exc
        raise TransportError(f"{url} unreachable ({exc.reason}); did the engine die?") from exc
    except (ConnectionError, OSError, http.client.HTTPException) as exc:
        # an engine killed mid-answer: a reset, or an answer cut short (IncompleteRead)
        raise TransportError(f"{url} broke the connection ({exc!r}); did the engine die?") from exc
    try:
        out = json.loads(raw) if raw.strip() else {}
    except ValueError:
        out = {"text": raw.decode(errors="replace")}
    if not isinstance(out, dict):
        out = {"result": out}
    if out.get("success") is False:
        raise BucketRejected(f"{url} refused: {out.get('message') or out.get('error_message')}")
    return out


class Fanout:
    """Runs one call per engine concurrently (a thread each) and gathers the answers.

    ``start`` returns at once; ``wait`` returns the answers in engine order and raises the first
    failure (after every call ended, so no call is left running behind the caller's back)."""

    def __init__(self, max_workers: int = 16) -> None:
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="miles-engine-call")

    def start(self, calls: Sequence[Callable[[], T]]) -> Callable[[], list[T]]:
        """Start ``calls``; the returned function waits for them."""
        futures = [self.pool.submit(c) for c in calls]

        def wait() -> list[T]:
            out: list[T] = []
            error: BaseException | None = None
            for f in futures:
                try:
                    out.append(f.result())
                except BaseException as exc:  # every call is waited for before raising
                    error = error or exc
            if error is not None:
                raise error
            return out

        return wait

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``calls`` concurrently and return their answers."""
        return self.start(calls)()

    def close(self) -> None:
        """Stop the worker threads (waits for calls in progress)."""
        self.pool.shutdown(wait=True)


def engine_urls(engines: Sequence[str], transport: str) -> list[str]:
    """The engines' base URLs without a trailing slash; at least one, else a ``ValueError``
    naming the ``transport``."""
    urls = [u.rstrip("/") for u in engines]
    if not urls:
        raise ValueError(f"{transport} transport: send needs at least one engine URL")
    return urls


def tensor_parallel_sizes(fanout: Fanout, urls: Sequence[str], timeout_s: float) -> dict[str, int]:
    """Each engine's tensor-parallel size, from its ``GET /get_server_info`` (1 when it does
    not say): SGLang takes one item per rank, and a group one rank per tensor-parallel rank."""
    infos = fanout.run(
        [
            lambda u=u: call(u, "/get_server_info", None, timeout_s=timeout_s, method="GET")
            for u in urls
        ]
    )
    return {u: int(info.get("tp_size") or 1) for u, info in zip(urls, infos, strict=True)}
