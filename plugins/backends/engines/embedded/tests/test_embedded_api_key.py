"""Where an embedded server binds, and the run's API key.

A server started with ``MILES_API_KEY`` answers 401 to a request without the key or with a wrong
one, on every endpoint but ``GET /health``; a server binds the address it is given, else its
node's (``MILES_NODE_ADDRESS``), and nothing else; a server asked to listen beyond loopback
without a key refuses to start, before it binds. Real server processes; every request goes to a
loopback address.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from miles_engine_client.binding import BindRefused, check_bind, url_host
from miles_engine_embedded.launcher import EngineStartError, bind_listening, build
from miles_engine_embedded.plugin import EmbeddedEngineConfig

from miles_core.hosts import API_KEY_ENV, NODE_ADDRESS_ENV

KEY = "run-key-" + "0123456789abcdef"
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}


def _options(**kw: object) -> EmbeddedEngineConfig:
    return EmbeddedEngineConfig(max_running_requests=2, num_threads=1, startup_timeout_s=120, **kw)


@pytest.fixture(autouse=True)
def _no_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the node address and the key it needs, and no other."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)


@pytest.fixture(scope="module")
def keyed(tiny_model: Path) -> Iterator[str]:
    """A server started with the run's key in its environment (this process's stays unset)."""
    launcher = build(_options())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, KEY)
        url = launcher.launch(str(tiny_model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


def test_a_request_without_the_key_is_refused(keyed: str) -> None:
    for method, path in (("POST", "/generate"), ("GET", "/server_info"), ("POST", "/flush_cache")):
        r = httpx.request(method, keyed + path, json=GENERATE if path == "/generate" else None)
        assert r.status_code == 401, (path, r.text)
        message = r.json()["error"]["message"]
        assert "Authorization: Bearer <key>" in message and API_KEY_ENV in message
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", ["Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"])
def test_a_wrong_key_is_refused(keyed: str, header: str) -> None:
    r = httpx.post(keyed + "/generate", json=GENERATE, headers={"Authorization": header})
    assert r.status_code == 401
    assert "wrong API key" in r.json()["error"]["message"]


def test_the_right_key_is_served_and_health_is_open(keyed: str) -> None:
    r = httpx.post(keyed + "/generate", json=GENERATE, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert httpx.get(keyed + "/health").status_code == 200
    # the key is checked before the body: an oversized body without it is a 401, not a 413
    r = httpx.post(keyed + "/flush_cache", content=b"x" * (1 << 17))
    assert r.status_code == 401


def test_no_key_no_check(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a key a server binds only loopback, and then asks for none; the node's address
    (``MILES_NODE_ADDRESS``) is where it binds and what the launcher returns, and the server
    listens there alone."""
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.4")
    launcher = build(_options())
    try:
        url = launcher.launch(str(tiny_model), index=0)
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.4:{port}"
        assert httpx.post(url + "/generate", json=GENERATE).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # refused: nothing listens there
    finally:
        launcher.shutdown()


def test_bind_rule() -> None:
    check_bind("127.0.0.1", "x")
    check_bind("127.0.0.4", "x")
    check_bind("::1", "x")
    check_bind("localhost", "x")
    for host in ("0.0.0.0", "10.255.255.1", "::", "node-1"):
        with pytest.raises(BindRefused, match=f"{API_KEY_ENV}"):
            check_bind(host, "an engine server")
    # the refusal comes before the socket: the address need not exist here
    with pytest.raises(BindRefused, match=r"'10\.255\.255\.1'"):
        bind_listening("10.255.255.1", 0, None)
    assert url_host("0.0.0.0") == "127.0.0.1" and url_host("::1") == "[::1]"


def test_bind_rule_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    for host in ("0.0.0.0", "10.255.255.1", "::"):
        check_bind(host, "an engine server")
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.9")
    assert url_host("0.0.0.0") == "127.0.0.9"


def test_server_beyond_loopback_without_a_key_exits(tmp_path: Path) -> None:
    """The server process refuses before it binds (an address this machine does not have,
    which a bind would refuse with another error) and before it loads a model (there is none
    at the path)."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "miles_engine_embedded.server", "--model-path",
         str(tmp_path / "none"), "--host", "10.255.255.1", "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--host: refusing to start an engine server on '10.255.255.1'" in out.stderr
    assert API_KEY_ENV in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 60


def test_launcher_reports_the_refusal(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.255.255.1")
    launcher = build(_options())
    try:
        with pytest.raises(
            EngineStartError, match=rf"(?s)exited with 1 \(log .*engine-0\.log\):.*{API_KEY_ENV}"
        ):
            launcher.launch(str(tiny_model), index=0)
    finally:
        launcher.shutdown()
