"""The HTTP connection to one engine server: one aiohttp session, JSON requests with
connection retries, the run's API key on every request, and a non-2xx answer raised as
:class:`EngineHTTPError` (a 401 as :class:`EngineAuthError`, which names the key to set)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, TypeVar

import aiohttp

from miles_core.hosts import API_KEY_ENV, auth_headers

C = TypeVar("C", bound="EngineConnection")


class EngineHTTPError(RuntimeError):
    """A non-2xx answer: carries the endpoint, the status and the server's message."""

    def __init__(self, endpoint: str, status: int, message: str) -> None:
        super().__init__(f"{endpoint} -> HTTP {status}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message


class EngineAuthError(EngineHTTPError):
    """The server refused the request's API key (HTTP 401): a configuration error, never
    retried. The message says which key to set."""

    def __init__(self, endpoint: str, status: int, message: str, *, base_url: str, sent: bool):
        sent_text = "a key it refused" if sent else "no key"
        super().__init__(
            endpoint,
            status,
            f"{message} (the server at {base_url} requires the run's API key and this client "
            f"sent {sent_text}: set {API_KEY_ENV} in this process to the key the server was "
            "started with)",
        )


class EngineConnection:
    """An HTTP connection to one engine server at ``base_url`` (e.g.
    ``http://127.0.0.1:30000``): one aiohttp session, created lazily in the running event loop
    and reused; use as ``async with`` or call :meth:`close`.

    Every request carries the run's API key (``Authorization: Bearer <key>``): ``api_key``
    when given, else ``MILES_API_KEY`` as it is when the connection is made; none without
    either."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float | None = None,
        connect_retries: int = 3,
        max_connections: int = 256,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else auth_headers()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.connect_retries = connect_retries
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=self.max_connections),
            )
        return self._session

    async def request(
        self, method: str, endpoint: str, body: Mapping[str, Any] | None = None
    ) -> Any:
        """Send one request; returns the parsed JSON (or text) answer, raises
        :class:`EngineHTTPError` on a non-2xx status (:class:`EngineAuthError` on a 401).
        Connection failures are retried ``connect_retries`` times (nothing was sent, so a retry
        cannot duplicate work)."""
        url = self.base_url + endpoint
        for attempt in range(self.connect_retries + 1):
            try:
                async with self._sess().request(method, url, json=body) as resp:
                    text = await resp.text()
                    if resp.status == 401:
                        raise EngineAuthError(
                            endpoint,
                            401,
                            _message(text),
                            base_url=self.base_url,
                            sent=bool(self.headers),
                        )
                    if resp.status >= 400:
                        raise EngineHTTPError(endpoint, resp.status, _message(text))
                    if resp.content_type == "application/json":
                        return await resp.json()
                    return text
            except aiohttp.ClientConnectorError:
                if attempt == self.connect_retries:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")


def _message(text: str) -> str:
    """The server's message in an error answer (SGLang's shapes), else the text."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if data.get("error_message"):  # SGLang's LoRAUpdateOutput
            return str(data["error_message"])
        if "message" in data:
            return str(data["message"])
    return text.strip()
