"""``miles train`` with ``algorithm: ppo`` on a tiny Qwen3: the FSDP2 trainer's critic in the
synchronous loop (with a resume from the loop's checkpoint, which holds the critic) and in the
fully asynchronous one under Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import DIVERSITY, QWEN3_TOKENS, save_tiny_qwen3, train, write_dist

pytestmark = pytest.mark.slow

# A reward that differs between the samples of a group even for a random model.

RAY = "{num_cpus: 2, trainer_cpus: 1, object_store_mb: 80, ready_timeout_s: 60}"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", vocab_size=QWEN3_TOKENS)


def _raw(tmp_path: Path, model: Path, mode: str) -> dict[str, Any]:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(40)
        )
    )
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
        raw["run"]["placement"] = "disaggregated"
        raw["engine"].update(num_threads=1, launch_in="ray_actor", ray_num_cpus=1)
        raw["transport"] = {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60}
        raw["algorithm"]["behaviour_policy"] = "rollout"
        raw["buffer"] = {"capacity": 4, "max_staleness": 2}
    return raw


def _rows(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval/accuracy" not in r]


def _check_ppo_rows(rows: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0]
    for r in rows:
        assert r["train/loss/value"] > 0 and r["train/critic/grad_norm"] > 0
        assert r["train/critic/lr"] == 1e-2 and r["train/grad_norm"] > 0
        assert r["train/explained_variance"] <= 1.0
        assert r["train/critic/skipped_nonfinite"] == 0.0


def test_ppo_sync_loop_and_resume(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = write_dist(tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY)
    raw = _raw(tmp_path, tiny_qwen3, "sync")
    raw["run"]["checkpoint_every"] = 1
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    first = train(config, "--set", "run.steps=1", site=site)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    resumed = train(config, "--resume", site=site)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    run = tmp_path / "runs" / "ppo"
    _check_ppo_rows(_rows(run))
    # The loop's checkpoints hold the critic (its schedule here, its weights and AdamW state
    # in the sharded part): the resumed run's first step was the critic's second.
    import torch

    for step, critic_steps in ((1, 1), (2, 2)):
        meta = torch.load(
            run / "checkpoints" / f"step_{step}" / "trainer" / "trainer.pt", weights_only=False
        )
        assert meta["critic"]["scheduler"]["_step_count"] == critic_steps + 1


def test_ppo_async_loop(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = write_dist(tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, tiny_qwen3, "async")))
    out = train(config, site=site, env={"MILES_RAY": RAY}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "step 2/2" in out.stderr
    _check_ppo_rows(_rows(tmp_path / "runs" / "ppo"))
