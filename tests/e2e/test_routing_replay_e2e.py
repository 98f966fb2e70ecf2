"""``miles train`` with ``rollout.routing: replay`` on a tiny Qwen3-MoE: two steps of the fully
asynchronous loop under Ray, the engine's routing record replayed in every MoE layer (expert
agreement 1.0) and every group accounted for in the ledger; and the refusals at start, each
exit 2 with its reason before any engine or trainer starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import (
    QWEN3_TOKENS,
    RAY,
    assert_ran,
    async_ray_config,
    diversity_site,
    train,
)

from miles_core.testing.tiny_moe import save_tiny_moe


def _raw(tmp_path: Path, model: Path) -> dict[str, Any]:
    raw = async_ray_config(
        tmp_path,
        model,
        name="r3",
        steps=2,
        prompts=40,
        max_running_requests=8,
        group_size=2,
        capacity=4,
        max_staleness=2,
    )
    raw["rollout"]["routing"] = "replay"
    return raw


@pytest.mark.slow
def test_replay_in_two_async_steps(tmp_path: Path) -> None:
    model = save_tiny_moe(
        tmp_path / "tiny-qwen3-moe", "qwen3_moe", vocab_size=QWEN3_TOKENS, seed=4, scale=4.0
    )
    site = diversity_site(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, model)))
    out = train(config, site=site, env={"MILES_RAY": RAY}, timeout=300)
    assert_ran(out)
    run = tmp_path / "runs" / "r3"
    rows = [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "eval/accuracy" not in r
    ]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/routing/expert_agreement"] == 1.0
        assert 0.0 <= r["train/routing/own_agreement"] <= 1.0
        assert r["train/routing/load_max_over_mean"] >= 1.0
        assert r["train/routing/bytes_per_token"] > 0
        assert r["train/grad_norm"] > 0
    # the trainer's Ray actor sends back each sample's agreement per token: the traces hold it
    traced = [json.loads(x) for x in (run / "traces.jsonl").read_text().splitlines()]
    assert {t["step"] for t in traced} == {1, 2}
    for t in traced:
        assert len(t["agree"]) == len(t["lp_t"]) > 0, t
        assert all(0.0 <= a <= 1.0 for a in t["agree"] if a is not None), t
        assert any(a is not None for a in t["agree"]), t
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["trained"] == 4 and ledger.get("in_flight", 0) == 0
    assert not any(
        k.startswith("dropped.") and k != "dropped.run_ended" and v for k, v in ledger.items()
    )


def _refused_config(tmp_path: Path, model: Path, **changes: Any) -> Path:
    raw = _raw(tmp_path, model)
    raw["reward"] = "last_number"
    for key, value in changes.items():
        section, _, field = key.partition("__")
        raw[section][field] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_replay_refusals_exit_2_with_the_reason(tmp_path: Path) -> None:
    """A dense model, and a trainer backend that does not take the routing (megatron), are
    refused at start with the field named."""
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "num_hidden_layers": 2, "intermediate_size": 64})
    )
    out = train(_refused_config(tmp_path, dense), timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "rollout.routing 'replay': model.path" in out.stderr
    assert "has no mixture-of-experts layer" in out.stderr

    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(
        json.dumps({"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2})
    )
    out = train(_refused_config(tmp_path, tmp_path / "moe", backend__name="megatron"), timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "trainer backend 'megatron' (backend.name) does not take" in out.stderr
    assert "backends that do: fsdp2" in out.stderr
