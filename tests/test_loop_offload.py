"""Colocated turn-taking (``run.offload``): while the trainer trains, the engine has released
its KV cache and the trainer is awake; while the engine generates, the trainer sleeps. The run
still syncs exactly: after each step the engine serves the trainer's weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from test_e2e_sync import reward_site, tiny_qwen3  # noqa: F401


@pytest.mark.slow
def test_engines_release_memory_while_the_trainer_trains(
    tiny_qwen3: Path,  # noqa: F811
    reward_site: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from miles_core.config import validate_config
    from miles_core.loop import SyncLoop
    from miles_core.plugins import load_plugins

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
        "model": {"path": str(tiny_qwen3), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
    }
    plugins = load_plugins()
    loop = SyncLoop(validate_config(raw, plugins.registry), plugins)
    seen: list[dict[str, Any]] = []
    try:
        loop.setup()
        assert loop.parts is not None
        trainer = loop.parts.trainer
        url = loop.clients[0].base_url
        calls: list[str] = []
        for name in ("sleep", "wake"):
            real = getattr(trainer, name)

            def spy(real: Any = real, name: str = name) -> None:
                calls.append(name)
                real()

            monkeypatch.setattr(trainer, name, spy)
        real_step = trainer.train_step

        def observed_step(groups: Any, algorithm: Any) -> Any:
            seen.append(asyncio.run(_state(url)))
            return real_step(groups, algorithm)

        monkeypatch.setattr(trainer, "train_step", observed_step)
        for _ in range(2):
            metrics = loop.train_step()
            assert metrics["train/mismatch/abs_max"] < 1e-4
        after = asyncio.run(_state(url))
    finally:
        loop.close("completed")
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
