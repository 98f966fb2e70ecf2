"""Colocated turn-taking (``run.offload``): while the trainer trains, the engine has released
its KV cache and the trainer is awake; while the engine generates, the trainer sleeps. The run
still syncs exactly: after each step the engine serves the trainer's weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow
def test_engines_release_memory_while_the_trainer_trains(
    tiny_qwen3_full_vocab: Path,
    reward_site: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from miles_core import hookimpl
    from miles_core.config import validate_config
    from miles_core.plugins import load_plugins
    from miles_core.runtime import Run, train

    monkeypatch.syspath_prepend(str(reward_site))
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 2?", "answer": i + 2}) + "\n" for i in range(20)
        )
    )
    raw = {
        "run": {
            "name": "offload",
            "output_dir": str(tmp_path / "runs"),
            "steps": 2,
            "offload": True,
        },
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
    run = Run(validate_config(raw, plugins.registry), plugins)
    seen: list[dict[str, Any]] = []
    calls: list[str] = []
    urls: list[str] = []

    class Spy:
        """Once the run is set up, records the trainer's sleeps and wakes, and the engine's
        state during every train step."""

        @hookimpl
        def miles_run_start(self, config: Any, run_dir: str) -> None:
            assert run.parts is not None and run.fleet is not None
            trainer = run.parts.trainer
            urls.append(run.fleet.engines[0].url)
            for name in ("sleep", "wake"):
                real = getattr(trainer, name)

                def spy(real: Any = real, name: str = name) -> None:
                    calls.append(name)
                    real()

                monkeypatch.setattr(trainer, name, spy)
            real_step = trainer.train_step

            def observed_step(groups: Any, algorithm: Any) -> Any:
                seen.append(asyncio.run(_state(urls[0])))
                return real_step(groups, algorithm)

            monkeypatch.setattr(trainer, "train_step", observed_step)

        @hookimpl
        def miles_after_weight_sync(self, step: int, version: int, metrics: Any) -> None:
            seen[-1]["after_sync"] = asyncio.run(_state(urls[0]))

    plugins.pm.register_plugin(Spy(), name="spy", distribution="test", version="0")
    train(run)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "offload" / "metrics.jsonl").open()]
    mismatch = [r["train/mismatch/abs_max"] for r in rows if "train/mismatch/abs_max" in r]
    assert len(mismatch) == 2 and max(mismatch) < 1e-4
    after = seen[-1]["after_sync"]
    # during each train step the engine had released its KV cache; afterwards it has it back
    assert [s["kv_cache_released"] for s in seen] == [True, True]
    assert after["kv_cache_released"] is False
    # awake from set-up to the first step; woken to save the final checkpoint
    assert calls == ["sleep", "wake", "sleep", "wake", "sleep"]


async def _state(url: str) -> dict[str, Any]:
    from miles_engine_client import EngineClient

    async with EngineClient(url, timeout_s=30) as c:
        info: dict[str, Any] = await c.get_server_info()
        return info["internal_states"][0]  # type: ignore[no-any-return]
