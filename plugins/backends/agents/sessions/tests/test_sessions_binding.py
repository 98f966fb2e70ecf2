"""Where the session server listens, and the run's API key: its node's address when no host is
given (``MILES_NODE_ADDRESS``), and ``MILES_API_KEY`` as its token when it has none of its own,
which then lets it listen beyond loopback. Real servers; every request goes to a loopback
address."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from miles_core.hosts import API_KEY_ENV, NODE_ADDRESS_ENV

KEY = "sessions-run-key-0123456789"


@pytest.fixture(autouse=True)
def _no_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the node address and the key it needs, and no other."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)


def test_sessions_listen_on_the_node_address(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.8")
    server, url = start_server()
    port = int(url.rsplit(":", 1)[1])
    assert server.options.host is None and url == f"http://127.0.0.8:{port}"
    assert httpx.post(f"{url}/sessions", json={}).status_code == 201  # no key: none asked
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # it listens there alone


def test_sessions_take_the_run_key_as_token(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    _, url = start_server()
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.post(f"{url}/sessions", json={}, headers=headers).status_code == 401
    ok = httpx.post(f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 201
    # a token of its own comes first
    own = "own-token-0123456789"
    _, url = start_server(token=own)
    refused = httpx.post(f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401
    assert httpx.post(
        f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {own}"}
    ).is_success


def test_sessions_beyond_loopback_need_a_token_or_the_run_key(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.255.255.1")
    with pytest.raises(ValueError, match=f"'10.255.255.1' without a token.*{API_KEY_ENV}"):
        SessionServer(family, None, SessionServerOptions())
    monkeypatch.setenv(API_KEY_ENV, KEY)
    server = SessionServer(family, None, SessionServerOptions())  # not started: nothing binds
    assert server.host == "10.255.255.1" and server.token == KEY
