"""The run's API key end to end: the engine client and the ``sglang`` router against a real
embedded engine started with ``MILES_API_KEY`` (the ``keyed_engine`` fixture).

The client sends the key it was made with (``MILES_API_KEY``, or ``api_key=``); a 401 is an
:class:`EngineAuthError` naming the variable, raised at once. The router is started with
``--api-key``: it requires the key and carries it to the engines, those it starts with and those
added at run time. Every request goes to a loopback address.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from miles_engine_client import EngineAuthError, EngineClient, EngineHTTPError
from miles_engine_client.plugin import SglangRouterOptions
from miles_engine_client.sglang_router import RouterError, SglangRouter

from miles_core.hosts import API_KEY_ENV, NODE_ADDRESS_ENV

SAMPLING = {"max_new_tokens": 3, "ignore_eos": True}
Keyed = tuple[str, str]


@pytest.fixture(autouse=True)
def _no_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the node address and the key it needs, and no other."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)


def _generate(client: EngineClient) -> list[int]:
    async def go() -> list[int]:
        async with client as c:
            return (await c.generate([5, 6, 7], SAMPLING)).output_ids

    return asyncio.run(go())


def test_client_sends_the_run_key(keyed_engine: Keyed, monkeypatch: pytest.MonkeyPatch) -> None:
    url, key = keyed_engine
    monkeypatch.setenv(API_KEY_ENV, key)
    client = EngineClient(url, timeout_s=60)
    monkeypatch.delenv(API_KEY_ENV)  # read when the client was made
    assert len(_generate(client)) == 3


def test_explicit_key_overrides_the_environment(
    keyed_engine: Keyed, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, key = keyed_engine
    assert len(_generate(EngineClient(url, api_key=key))) == 3
    monkeypatch.setenv(API_KEY_ENV, "another")
    assert len(_generate(EngineClient(url, api_key=key))) == 3


@pytest.mark.parametrize(("key", "says"), [(None, "sent no key"), ("wrong", "a key it refused")])
def test_refused_key_is_a_clear_error_at_once(
    keyed_engine: Keyed, monkeypatch: pytest.MonkeyPatch, key: str | None, says: str
) -> None:
    url, _ = keyed_engine
    if key is not None:
        monkeypatch.setenv(API_KEY_ENV, key)
    start = time.monotonic()
    with pytest.raises(EngineAuthError) as err:
        _generate(EngineClient(url, timeout_s=60))
    assert time.monotonic() - start < 10  # no retry loop, no wait for a timeout
    assert err.value.status == 401 and isinstance(err.value, EngineHTTPError)
    message = str(err.value)
    assert says in message and f"set {API_KEY_ENV}" in message and url in message


def test_health_is_open_and_a_refused_key_is_no_unhealthy_engine(keyed_engine: Keyed) -> None:
    async def go() -> bool:
        async with EngineClient(keyed_engine[0]) as c:
            assert await c.health()
            return await c.health_generate()

    with pytest.raises(EngineAuthError, match=API_KEY_ENV):
        asyncio.run(go())


def test_router_beyond_loopback_needs_the_key(tmp_path: Path) -> None:
    router = SglangRouter(SglangRouterOptions(host="10.255.255.1", log_dir=str(tmp_path)))
    with pytest.raises(RouterError, match=rf"router 'sglang' on '10\.255\.255\.1'.*{API_KEY_ENV}"):
        router.start(["http://127.0.0.1:1"])
    assert router.process is None


def test_router_binds_the_node_address_and_carries_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.5")
    plain = SglangRouter().command(["http://127.0.0.1:1"], 2, 3)
    assert "--api-key" not in plain
    assert plain[plain.index("--host") + 1] == "127.0.0.5"
    assert plain[plain.index("--prometheus-host") + 1] == "127.0.0.5"
    monkeypatch.setenv(API_KEY_ENV, "k")
    keyed = SglangRouter().command(["http://127.0.0.1:1"], 2, 3)
    assert keyed[keyed.index("--api-key") + 1] == "k"


@pytest.mark.slow
def test_router_requires_the_key_and_gives_it_to_the_engine(
    keyed_engine: Keyed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    engine, key = keyed_engine
    monkeypatch.setenv(API_KEY_ENV, key)
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.5")
    router = SglangRouter(SglangRouterOptions(startup_timeout_s=30, log_dir=str(tmp_path)))
    try:
        url = router.start([engine])  # its control calls send the key
        assert url.startswith("http://127.0.0.5:")
        assert len(_generate(EngineClient(url))) == 3  # forwarded to the engine with the key
        with pytest.raises(EngineAuthError, match="sent a key it refused"):
            _generate(EngineClient(url, api_key="wrong"))
        # an engine added at run time is given the key: the router reads its /model_info
        router.set_engines([])
        router.set_engines([engine])
        [worker] = router.workers()
        assert worker["model_id"] != "unknown"
        assert len(_generate(EngineClient(url))) == 3
        assert key not in router.log_tail(n=1_000_000)
    finally:
        router.stop()
