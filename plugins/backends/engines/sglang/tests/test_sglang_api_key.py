"""Where an SGLang server binds, and the run's API key: the node's address by default, SGLang's
``--api-key`` from ``MILES_API_KEY``, a host beyond loopback refused without it. The command
line is checked without SGLang; the launcher part starts the stand-in server
(``sglang_launcher_standin.py``, not SGLang), which keeps SGLang's ``--api-key`` rule."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
from miles_engine_client import EngineAuthError, EngineClient
from miles_engine_client.binding import BindRefused
from miles_engine_sglang.command import HIDDEN, base_url, build_command, loggable
from miles_engine_sglang.launcher import EngineStartError, SGLangLauncher
from miles_engine_sglang.options import SGLangEngineConfig
from pydantic import ValidationError

from miles_core.hosts import API_KEY_ENV, NODE_ADDRESS_ENV

KEY = "k-" + "s3cret" * 4

Options = Callable[..., SGLangEngineConfig]


@pytest.fixture(autouse=True)
def _no_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the node address and the key it needs, and no other."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_host_defaults_to_the_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = SGLangEngineConfig()
    assert opts.host is None
    assert _value(build_command("/m", 0, opts), "--host") == "127.0.0.1"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.3")
    assert _value(build_command("/m", 1, opts), "--host") == "127.0.0.3"
    assert base_url(1, opts) == "http://127.0.0.3:30010"


def test_api_key_is_sglangs_flag_and_kept_out_of_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "--api-key" not in build_command("/m", 0, SGLangEngineConfig())
    monkeypatch.setenv(API_KEY_ENV, KEY)
    cmd = build_command("/m", 0, SGLangEngineConfig())
    assert _value(cmd, "--api-key") == KEY
    shown = loggable(cmd)
    assert KEY not in shown and _value(shown, "--api-key") == HIDDEN
    assert shown[: cmd.index("--api-key")] == cmd[: cmd.index("--api-key")]


@pytest.mark.parametrize("host", ["10.255.255.1", "0.0.0.0", "::", "node1.cluster"])
def test_host_beyond_loopback_needs_the_key(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    opts = SGLangEngineConfig(host=host)
    with pytest.raises(BindRefused, match=f"{API_KEY_ENV}.*or bind a loopback address"):
        build_command("/m", 0, opts)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    cmd = build_command("/m", 0, opts)
    assert _value(cmd, "--host") == host and _value(cmd, "--api-key") == KEY


def test_node_address_beyond_loopback_needs_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.255.255.1")
    with pytest.raises(BindRefused, match=r"SGLang engine 2 on '10\.255\.255\.1'"):
        build_command("/m", 2, SGLangEngineConfig())


def test_wildcard_bind_is_reached_at_the_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert base_url(0, SGLangEngineConfig(host="0.0.0.0")) == "http://127.0.0.1:30000"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.6")
    assert base_url(0, SGLangEngineConfig(host="0.0.0.0")) == "http://127.0.0.6:30000"
    assert base_url(0, SGLangEngineConfig(host="::1")) == "http://[::1]:30000"


def test_extra_args_must_not_set_the_key() -> None:
    with pytest.raises(ValidationError, match="extra_args must not set --api-key"):
        SGLangEngineConfig(extra_args=["--api-key", "x"])


def test_launch_refuses_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, standin_options: Options
) -> None:
    opts = standin_options(host="10.255.255.1")
    with SGLangLauncher(opts) as launcher:
        with pytest.raises(EngineStartError, match=API_KEY_ENV):
            launcher.launch("standin:ok", index=0)
        assert launcher.processes == {}


def test_launched_server_requires_the_key_and_the_log_hides_it(
    monkeypatch: pytest.MonkeyPatch, standin_options: Options
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setenv(NODE_ADDRESS_ENV, "127.0.0.7")
    opts = standin_options()
    with SGLangLauncher(opts) as launcher:
        url = launcher.launch("standin:ok", index=0)  # /health answers without the key
        assert url == f"http://127.0.0.7:{opts.port}"
        with socket.socket() as s:  # bound to the node address alone
            assert s.connect_ex(("127.0.0.1", opts.port)) != 0

        async def generate(client: EngineClient) -> list[int]:
            async with client as c:
                return (await c.generate([5, 6], {"max_new_tokens": 2})).output_ids

        assert asyncio.run(generate(launcher.client(url))) == [7, 8]
        with pytest.raises(EngineAuthError, match=f"sent a key it refused: set {API_KEY_ENV}"):
            asyncio.run(generate(EngineClient(url, api_key="wrong")))
        monkeypatch.delenv(API_KEY_ENV)
        with pytest.raises(EngineAuthError, match=f"sent no key: set {API_KEY_ENV}"):
            asyncio.run(generate(launcher.client(url)))
        # the launcher's line of the log (the stand-in itself prints its argv after it)
        first = launcher.logs[0].read_text().splitlines()[0]
        assert first.startswith("# miles: ") and "--api-key" in first and KEY not in first
