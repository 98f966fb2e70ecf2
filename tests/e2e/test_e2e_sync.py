"""End to end: the synchronous loop on a tiny model with the real plugins — FSDP2 trainer,
embedded engine process, colocated shared-memory transport, GRPO, the qwen3 family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import assert_ran, metric_rows, train, write_prompts

# A reward that differs between the samples of a group even for a random model (a hash of the
# response's token ids), so every step has a learning signal and changes the weights.


def _config(tmp_path: Path, model: Path, **run: object) -> Path:
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    cfg = {
        "run": {"name": "e2e", "output_dir": str(tmp_path / "runs"), "steps": 3, **run},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 6},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_sync_loop_colocated_end_to_end(
    tiny_qwen3_full_vocab: Path, reward_site: Path, tmp_path: Path
) -> None:
    out = train(_config(tmp_path, tiny_qwen3_full_vocab, checkpoint_every=1), site=reward_site)
    assert_ran(out)
    run = tmp_path / "runs" / "e2e"
    rows = metric_rows(run, evals=True)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(r["eval/n"] == 6 for r in evals)
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0, 3.0]
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["n_heldout"] == 6 and final["steps"] == 3
    assert {"accuracy_before", "accuracy_after"} <= set(final)
    assert (run / "plot.png").stat().st_size > 1000
    for s in steps:
        assert s["train/grad_norm"] > 0  # the reward varies: every step changes the weights
        # every group accounted for, nothing lost
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
    # After each sync the engine samples with exactly the trainer's weights: its log-probs and
    # the trainer's recomputed ones agree, which they would not if the update were lost.
    for s in steps[1:]:
        assert s["train/mismatch/abs_max"] < 1e-4, s["train/mismatch/abs_max"]
        assert s["sync/bytes"] > 0
    assert (run / "checkpoints" / "step_3" / "loop.json").is_file()
    meta = json.loads((run / "run.json").read_text())
    assert {
        "miles-core",
        "miles-backend-fsdp2",
        "miles-engine-embedded",
        "miles-transport-colocated",
    } <= set(meta["distributions"])
    assert "step 3/3" in out.stderr


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(
    tiny_qwen3_full_vocab: Path, reward_site: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, tiny_qwen3_full_vocab, checkpoint_every=1)
    first = train(config, "--set", "run.steps=1", site=reward_site)
    assert first.returncode == 0, first.stderr[-5000:]
    resumed = train(config, "--resume", site=reward_site)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    steps = metric_rows(tmp_path / "runs" / "e2e")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0, 3.0]
    assert [s["ledger/produced"] for s in steps] == [2.0, 4.0, 6.0]
    # the resumed engines serve the checkpoint's weights, not the initial ones
    assert steps[1]["train/mismatch/abs_max"] < 1e-4
    missing = train(config, "--resume", "--set", "run.name=other", site=reward_site)
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr
