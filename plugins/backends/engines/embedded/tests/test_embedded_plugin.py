"""Registration through the ``miles`` entry point, options validation, and the launcher."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import miles_engine_embedded.launcher as launcher_module
import pytest
from miles_engine_client import EngineClient
from miles_engine_embedded.launcher import EmbeddedLauncher, EngineStartError
from miles_engine_embedded.plugin import EmbeddedEngineConfig
from pydantic import ValidationError

from miles_core import Kind
from miles_core.contracts import EngineClient as CoreEngineClient
from miles_core.contracts import EngineLauncher
from miles_core.plugins import load_plugins


def test_registered_through_entry_point() -> None:
    plugins = load_plugins(allow=["embedded"])
    engine = plugins.registry.get(Kind.ROLLOUT_ENGINE, "embedded")
    assert engine.config is EmbeddedEngineConfig
    launcher = engine.build(EmbeddedEngineConfig(max_running_requests=2))
    assert isinstance(launcher, EngineLauncher)
    assert launcher.options.max_running_requests == 2
    assert isinstance(launcher.client("http://127.0.0.1:1"), CoreEngineClient)
    assert plugins.registry.owner(Kind.ROLLOUT_ENGINE, "embedded").distribution == (
        "miles-engine-embedded"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"max_running_requests": 0},
        {"dtype": "float8"},
        {"port": 70000},
        {"unknown": 1},
        {"startup_timeout_s": 0},
    ],
)
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        EmbeddedEngineConfig.model_validate(bad)


def test_launch_failure_reports_the_log(tmp_path: Path) -> None:
    # In the temp folder of the logs, a failed start's log stays for whoever reads why.
    launcher = EmbeddedLauncher(EmbeddedEngineConfig(startup_timeout_s=120))
    with pytest.raises(EngineStartError, match="exited") as failed:
        launcher.launch(str(tmp_path / "no-model"), index=0)
    log = Path(launcher.logs[0])
    launcher.shutdown()
    try:
        assert log.name == "engine-0.log" and f"(log {log})" in str(failed.value)
        assert "no-model" in log.read_text()
    finally:
        shutil.rmtree(log.parent)
    # In the run's log_dir, where a second start of the same engine appends to its log.
    logs = tmp_path / "logs"
    launcher = EmbeddedLauncher(EmbeddedEngineConfig(startup_timeout_s=120, log_dir=str(logs)))
    for _ in range(2):
        with pytest.raises(EngineStartError, match="exited"):
            launcher.launch(str(tmp_path / "no-model"), index=3)
    launcher.shutdown()
    assert sorted(p.name for p in logs.iterdir()) == ["engine-3.log"]
    assert (logs / "engine-3.log").read_text().count("no-model") >= 2


@pytest.mark.slow
def test_two_engines_launch_and_shut_down(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A port another process takes between a pick and the server's bind must not stop a
    # launch: here every "free" port a picker could return is already listening.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(launcher_module, "free_port", lambda host="": taken.getsockname()[1])
    launcher = EmbeddedLauncher(
        EmbeddedEngineConfig(num_threads=1, max_running_requests=2, dist_timeout=7.5)
    )
    urls = [launcher.launch(str(tiny_model), index=i) for i in range(2)]
    assert len(set(urls)) == 2
    assert all(not u.endswith(f":{taken.getsockname()[1]}") for u in urls)
    taken.close()

    async def ask() -> list[bool]:
        out = []
        for url in urls:
            async with EngineClient(url) as c:
                r = await c.generate([1, 2, 3], {"max_new_tokens": 2})
                out.append(len(r.output_ids) == 2)
                # the update group's waits are bounded as configured (SGLang's --dist-timeout)
                info = await c.get_server_info()
                out.append(info["dist_timeout"] == 7.5)
                # the server reports the port it bound, not the 0 it was asked for
                out.append(url.endswith(f":{info['port']}"))
        return out

    assert asyncio.run(ask()) == [True] * 6
    procs = list(launcher.processes.values())
    logs = Path(launcher.logs[0]).parent
    assert sorted(p.name for p in logs.iterdir()) == ["engine-0.log", "engine-1.log"]
    launcher.shutdown()
    assert all(p.poll() is not None for p in procs)
    # engines stopped when asked: their logs and the temp folder went with them
    assert not logs.exists()

    async def dead() -> bool:
        async with EngineClient(urls[0], connect_retries=0) as c:
            return await c.health()

    assert asyncio.run(dead()) is False
