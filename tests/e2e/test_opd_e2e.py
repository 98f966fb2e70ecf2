"""``miles train`` with ``algorithm: on_policy_distillation``: a teacher served by its own
embedded engine scores every sampled token, on the synchronous loop (where a teacher equal to
the policy gives a reverse KL of zero, and a teacher engine killed mid-run is restarted and the
group scored again) and on the fully asynchronous one under Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import (
    BROADCAST,
    DIVERSITY,
    QWEN3_TOKENS,
    RAY,
    assert_ran,
    metric_rows,
    place_on_ray,
    save_tiny_qwen3,
    train,
    write_dist,
    write_prompts,
)

pytestmark = pytest.mark.slow

# A reward (distillation does not use it, the run's metrics do) and a hook that kills the
# teacher's engine server before the first train step, so the second step's scoring finds it
# dead.
PLUGIN = (
    "\nimport os, subprocess"
    + DIVERSITY
    + """
@hookimpl
def miles_before_train_step(step, groups):
    teacher = os.environ.get("KILL_TEACHER")
    if teacher and step == 1:
        subprocess.run(["pkill", "-KILL", "-f", "model-path " + teacher], check=True)
"""
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    student = save_tiny_qwen3(root / "student", vocab_size=QWEN3_TOKENS)
    teacher = save_tiny_qwen3(root / "teacher", vocab_size=QWEN3_TOKENS, seed=1)
    return student, teacher


def _raw(tmp_path: Path, student: Path, teacher: Path, mode: str) -> dict[str, Any]:
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    raw: dict[str, Any] = {
        "run": {"name": "opd", "output_dir": str(tmp_path / "runs"), "steps": 2, "mode": mode},
        "model": {"path": str(student), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "on_policy_distillation"},
        "teacher": {"path": str(teacher)},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    if mode == "async":
        place_on_ray(raw, max_staleness=1)
        raw["teacher"]["engine"] = {"name": "embedded", "num_threads": 1}
        raw["transport"] = dict(BROADCAST)
    return raw


def _check(rows: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0]
    # Cumulative; the asynchronous loop scores groups ahead of the trainer.
    assert rows[0]["teacher/scored_tokens"] >= rows[0]["train/response_tokens"] > 0
    assert rows[1]["teacher/scored_tokens"] >= rows[0]["teacher/scored_tokens"]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r.get("ledger/dropped.teacher_failed", 0) == 0


def test_opd_sync_loop_a_teacher_equal_to_the_policy_and_a_dead_teacher(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    student, teacher = models
    site = write_dist(tmp_path / "site", "miles-opd-test", "miles_opd_test", PLUGIN)
    config = tmp_path / "run.yaml"

    # The policy as its own teacher: the teacher's engine scores the sampled tokens as the
    # trainer does, so the first step's reverse KL is zero up to the kernels' rounding.
    config.write_text(yaml.safe_dump(_raw(tmp_path, student, student, "sync")))
    out = train(config, "--set", "run.steps=1", site=site)
    assert_ran(out)
    (row,) = metric_rows(tmp_path / "runs" / "opd")
    assert abs(row["train/reverse_kl"]) < 1e-4
    assert row["teacher/scored_tokens"] == row["train/response_tokens"]

    # Another teacher, whose engine is killed before the first train step: the second step's
    # scoring finds it dead, it is restarted from the teacher's checkpoint and the groups are
    # scored again; every group is trained.
    config.write_text(yaml.safe_dump(_raw(tmp_path, student, teacher, "sync")))
    out = train(config, "--set", "run.export=true", site=site, env={"KILL_TEACHER": str(teacher)})
    assert_ran(out)
    assert "teacher: engine(s) [0] died while scoring" in out.stderr
    rows = metric_rows(tmp_path / "runs" / "opd")
    _check(rows)
    assert rows[0]["train/reverse_kl"] > 1e-3  # a teacher of other weights disagrees
    assert [r["teacher/restarts"] for r in rows] == [0.0, 1.0]
    ledger = json.loads((tmp_path / "runs" / "opd" / "ledger.json").read_text())
    assert ledger["trained"] == 4 and ledger.get("dropped.teacher_failed", 0) == 0

    # run.export: the trained policy as a checkpoint transformers loads (what a later run can
    # take as its teacher): the same tensors, trained.
    from transformers import AutoModelForCausalLM

    exported = json.loads(out.stdout.strip().splitlines()[-1])["model"]
    assert Path(exported) == tmp_path / "runs" / "opd" / "model"
    trained = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    start = AutoModelForCausalLM.from_pretrained(student).state_dict()
    assert trained.keys() == start.keys()
    assert any(not trained[k].equal(start[k]) for k in start)


def test_opd_async_loop(models: tuple[Path, Path], tmp_path: Path) -> None:
    student, teacher = models
    site = write_dist(tmp_path / "site", "miles-opd-test", "miles_opd_test", PLUGIN)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, student, teacher, "async")))
    out = train(config, site=site, env={"MILES_RAY": RAY}, timeout=300)
    assert_ran(out)
    assert "step 2/2" in out.stderr
    rows = metric_rows(tmp_path / "runs" / "opd")
    _check(rows)
    assert all(0.0 <= r["train/is_truncated_fraction"] <= 1.0 for r in rows)


def test_opd_refuses_a_teacher_of_another_tokenizer(tmp_path: Path) -> None:
    student = save_tiny_qwen3(tmp_path / "student", vocab_size=QWEN3_TOKENS)
    teacher = save_tiny_qwen3(tmp_path / "teacher", vocab_size=QWEN3_TOKENS + 64)
    site = write_dist(tmp_path / "site", "miles-opd-test", "miles_opd_test", PLUGIN)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, student, teacher, "sync")))
    out = train(config, site=site, timeout=120)
    assert out.returncode != 0
    assert "teacher.path" in out.stderr and "vocab_size 151733" in out.stderr
    assert not (tmp_path / "runs" / "opd" / "metrics.jsonl").exists()
