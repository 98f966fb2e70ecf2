"""``miles train`` with ``algorithm: ppo`` on a tiny Qwen3: the FSDP2 trainer's critic in the
synchronous loop (with a resume from the loop's checkpoint, which holds the critic) and in the
fully asynchronous one under Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import (
    BROADCAST,
    RAY,
    assert_ran,
    diversity_site,
    metric_rows,
    place_on_ray,
    train,
    write_prompts,
)

pytestmark = pytest.mark.slow

# A reward that differs between the samples of a group even for a random model.


def _raw(tmp_path: Path, model: Path, mode: str) -> dict[str, Any]:
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    raw: dict[str, Any] = {
        "run": {"name": "ppo", "output_dir": str(tmp_path / "runs"), "steps": 2, "mode": mode},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1, "critic": {"lr": 1e-2}},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "ppo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    if mode == "async":
        place_on_ray(raw)
        raw["transport"] = dict(BROADCAST)
        raw["algorithm"]["behaviour_policy"] = "rollout"
    return raw


def _check_ppometric_rows(rows: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0]
    for r in rows:
        assert r["train/loss/value"] > 0 and r["train/critic/grad_norm"] > 0
        assert r["train/critic/lr"] == 1e-2 and r["train/grad_norm"] > 0
        assert r["train/explained_variance"] <= 1.0
        assert r["train/critic/skipped_nonfinite"] == 0.0


def test_ppo_sync_loop_and_resume(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = diversity_site(tmp_path)
    raw = _raw(tmp_path, tiny_qwen3, "sync")
    raw["run"]["checkpoint_every"] = 1
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    first = train(config, "--set", "run.steps=1", site=site)
    assert_ran(first)
    resumed = train(config, "--resume", site=site)
    assert_ran(resumed)
    run = tmp_path / "runs" / "ppo"
    _check_ppometric_rows(metric_rows(run))
    # The loop's checkpoints hold the critic (its schedule here, its weights and AdamW state
    # in the sharded part): the resumed run's first step was the critic's second.
    import torch

    for step, critic_steps in ((1, 1), (2, 2)):
        meta = torch.load(
            run / "checkpoints" / f"step_{step}" / "trainer" / "trainer.pt", weights_only=False
        )
        assert meta["critic"]["scheduler"]["_step_count"] == critic_steps + 1


def test_ppo_async_loop(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = diversity_site(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, tiny_qwen3, "async")))
    out = train(config, site=site, env={"MILES_RAY": RAY}, timeout=300)
    assert_ran(out)
    assert "step 2/2" in out.stderr
    _check_ppometric_rows(metric_rows(tmp_path / "runs" / "ppo"))
