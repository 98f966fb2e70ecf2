"""``miles train`` with ``run.mode: async``: the refusals at start, each exit 2 with its reason
and before any engine or trainer starts (the run that goes through is in e2e/test_async_ray.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import train


def _config(tmp_path: Path, **changes: Any) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "answer": 2}) + "\n")
    cfg: dict[str, Any] = {
        "run": {
            "name": "refused",
            "output_dir": str(tmp_path / "runs"),
            "mode": "async",
            "placement": "disaggregated",
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2"},
        "engine": {"name": "embedded", "launch_in": "ray_actor"},
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": {"name": "broadcast"},
        "reward": "last_number",
        "data": {"name": "jsonl", "path": str(data)},
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        cfg[section][field] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            {"run__placement": "colocated", "transport__name": "colocated"},
            "run.mode 'async' cannot run with run.placement 'colocated'",
        ),
        (
            {"algorithm__behaviour_policy": None},
            "its off-policy correction must be chosen explicitly: set algorithm.behaviour_policy",
        ),
    ],
    ids=["async-on-colocated", "no-off-policy-choice"],
)
def test_async_refusals_exit_2_with_the_reason(
    tmp_path: Path, changes: dict[str, Any], reason: str
) -> None:
    out = train(_config(tmp_path, **changes), timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert reason in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run began


def test_async_without_a_placement_plugin_is_refused(tmp_path: Path) -> None:
    # the Ray placement blocked: nothing can place a disaggregated run
    config = _config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["plugins"] = {"block": ["ray"]}
    config.write_text(yaml.safe_dump(raw))
    out = train(config, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "run.placement 'disaggregated' needs a placement plugin" in out.stderr
