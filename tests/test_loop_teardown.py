"""A run's teardown: every part set up registers its close, and leaving the run closes them in
the reverse order, each one whatever failed before it; the engine servers are gone after it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest


async def _answers(url: str) -> bool:
    from miles_engine_client import EngineClient

    async with EngineClient(url, timeout_s=5) as client:
        return await client.health()


@pytest.mark.slow
def test_a_failing_run_closes_every_part_in_reverse_order_despite_a_failing_close(
    tiny_qwen3_full_vocab: Path,
    reward_site: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from miles_core import hookimpl
    from miles_core.config import validate_config
    from miles_core.plugins import load_plugins
    from miles_core.runtime import Run, train
    from miles_core.runtime.fleet import EngineFleet
    from miles_core.runtime.io import IOThread
    from miles_core.runtime.reporter import Reporter
    from miles_core.runtime.schedules import Feed
    from miles_core.runtime.state import Saver

    monkeypatch.syspath_prepend(str(reward_site))
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 2?", "answer": i}) + "\n" for i in range(8))
    )
    raw = {
        "run": {"name": "teardown", "output_dir": str(tmp_path / "runs"), "steps": 1},
        "model": {
            "path": str(tiny_qwen3_full_vocab),
            "family": "qwen3",
            "accept_unverified_family": True,
        },
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
    }
    plugins = load_plugins()
    run = Run(validate_config(raw, plugins.registry), plugins, progress="off")
    closed: list[str] = []
    urls: list[str] = []
    ends: list[str] = []

    def record(name: str, cls: type, method: str, fails: bool = False) -> None:
        real = getattr(cls, method)

        def spy(self: object, *args: object) -> object:
            closed.append(name)
            out = real(self, *args)
            if fails:
                raise RuntimeError(f"{name} failed to close")
            return out

        monkeypatch.setattr(cls, method, spy)

    record("feed", Feed, "close")
    record("saver", Saver, "close", fails=True)
    record("fleet", EngineFleet, "close")
    record("reporter", Reporter, "close")
    record("io", IOThread, "close")

    class Probe:
        @hookimpl
        def miles_run_start(self, config: object, run_dir: str) -> None:
            assert run.fleet is not None
            urls.append(run.fleet.engines[0].url)
            raise RuntimeError("the probe fails the run once every part is set up")

        @hookimpl
        def miles_run_end(self, config: object, run_dir: str, status: str) -> None:
            ends.append(status)

    plugins.pm.register_plugin(Probe(), name="probe", distribution="test", version="0")
    with pytest.raises(RuntimeError, match="saver failed to close") as raised:
        train(run)
    # The closes ran after the saver's failure too, in the reverse order of set-up; the
    # probe's error is the context of the close that failed after it.
    assert closed == ["feed", "saver", "fleet", "reporter", "io"]
    assert "the probe fails the run" in str(raised.value.__context__)
    assert ends == ["failed"]
    assert json.loads((tmp_path / "runs" / "teardown" / "ledger.json").read_text()) is not None
    try:
        alive = asyncio.run(_answers(urls[0]))
    except OSError:
        alive = False
    assert not alive  # the launcher stopped the engine's server
