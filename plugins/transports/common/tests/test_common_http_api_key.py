"""The transports' HTTP calls carry the run's API key (``MILES_API_KEY``), and an engine's 401
is an error that names it. A real HTTP server on a loopback address stands for the engine: it
requires ``Authorization: Bearer <key>`` as the engine servers do."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.http import call

from miles_core.hosts import API_KEY_ENV

KEY = "transport-key-0123456789"


class _KeyedHandler(BaseHTTPRequestHandler):
    """Answers ``{"success": true, "got": <body>}``, or 401 without the key."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._answer(401, {"error": {"message": "missing or wrong API key"}})
        else:
            self._answer(200, {"success": True, "got": json.loads(body or b"{}")})

    def _answer(self, status: int, data: dict[str, object]) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keyed_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_call_sends_the_run_key(keyed_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    out = call(keyed_server, "/update_weight_version", {"new_version": "3"}, timeout_s=10)
    assert out == {"success": True, "got": {"new_version": "3"}}


@pytest.mark.parametrize(("key", "says"), [(None, "sent no key"), ("wrong", "a key it refused")])
def test_refused_key_names_the_variable(
    keyed_server: str, monkeypatch: pytest.MonkeyPatch, key: str | None, says: str
) -> None:
    if key is not None:
        monkeypatch.setenv(API_KEY_ENV, key)
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        call(keyed_server, "/update_weight_version", {"new_version": "3"}, timeout_s=10)
    assert time.monotonic() - start < 5
    assert not isinstance(err.value, BucketRejected)  # no bucket was at fault
    message = str(err.value)
    assert "HTTP 401" in message and says in message and f"set {API_KEY_ENV}" in message
