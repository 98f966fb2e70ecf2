"""``miles train`` with ``adapter: lora`` on a tiny Qwen3: the FSDP2 trainer trains the adapter
alone, the transport publishes the adapter alone, and the embedded engine serves it (every
generation names it) — checked by the train/rollout log-prob mismatch after the first update,
which is large if the engines served anything but the trained adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import (
    RAY,
    assert_ran,
    diversity_site,
    metric_rows,
    place_on_ray,
    save_tiny_qwen3,
    train,
    write_prompts,
)

pytestmark = pytest.mark.slow


def _raw(tmp_path: Path, model: Path, transport: str, mode: str = "sync") -> dict[str, Any]:
    """The run config; the transports' adapter path is tested one by one in
    ``test_adapter_sync.py``."""
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    raw: dict[str, Any] = {
        "run": {"name": "lora", "output_dir": str(tmp_path / "runs"), "steps": 2, "mode": mode},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 5e-2, "cpu_threads": 1},
        "adapter": {"name": "lora", "rank": 4, "alpha": 8},
        "engine": {"name": "embedded", "max_running_requests": 8, "enable_lora": True},
        "algorithm": {"name": "grpo"},
        "transport": {"name": transport, "timeout_s": 60},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    if mode == "async":
        place_on_ray(raw)
        raw["algorithm"]["behaviour_policy"] = "rollout"
    return raw


def _check(rows: list[dict[str, Any]], *, exact: bool = True) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0]
    for r in rows:
        assert r["train/grad_norm"] > 0
        # The adapter alone travels: a rank-4 adapter of the tiny model is a few percent of it.
        assert 0 < r["sync/bytes"] < 200_000, r["sync/bytes"]
    if exact:
        # Step 2 generated with the adapter of step 1: the engine's log-probs are the trainer's.
        assert rows[1]["train/mismatch/abs_max"] < 1e-4, rows[1]["train/mismatch/abs_max"]


def test_lora_sync_loop_and_export(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = diversity_site(tmp_path)
    raw = _raw(tmp_path, tiny_qwen3, "colocated")
    raw["run"]["export"] = True
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = train(config, site=site)
    assert_ran(out)
    run = tmp_path / "runs" / "lora"
    _check(metric_rows(run))
    # The export: the adapter in PEFT's format, and the merged model, agree.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32)(
            ids
        ).logits
    assert (peft_logits - plain).abs().max() > 1e-4  # it trained
    torch.testing.assert_close(merged, peft_logits, atol=1e-4, rtol=0)


def test_lora_sync_loop_on_megatron(tmp_path: Path) -> None:
    """The same run on the Megatron backend (tensor parallel 2, spawned ranks; a tiny Qwen3
    whose heads, key/value groups and vocabulary two ranks divide): the adapter alone trains
    and travels, the engine serves what the trainer trained, and the export's PEFT folder and
    merged model agree."""
    tiny_qwen3 = save_tiny_qwen3(tmp_path / "tiny-qwen3-tp", heads=4, kv_heads=2)
    site = diversity_site(tmp_path)
    raw = _raw(tmp_path, tiny_qwen3, "colocated")
    raw["backend"] = {"name": "megatron", "lr": 5e-2, "cpu_threads": 1, "tensor_parallel": 2}
    raw["run"]["export"] = True
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = train(config, site=site)
    assert_ran(out)
    run = tmp_path / "runs" / "lora"
    _check(metric_rows(run))
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32)(
            ids
        ).logits
    assert (peft_logits - plain).abs().max() > 1e-4  # it trained
    torch.testing.assert_close(merged, peft_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_lora_async_loop_broadcast(backend: str, tiny_qwen3: Path, tmp_path: Path) -> None:
    """The asynchronous loop under Ray on either trainer backend: the adapter alone trains
    and travels through the broadcast transport, every group is accounted for."""
    site = diversity_site(tmp_path)
    raw = _raw(tmp_path, tiny_qwen3, "broadcast", "async")
    raw["backend"]["name"] = backend
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = train(config, site=site, env={"MILES_RAY": RAY}, timeout=300)
    assert_ran(out)
    assert "step 2/2" in out.stderr
    # Asynchronous: a step may train on samples of the previous adapter (their behaviour
    # log-probs are the rollout's), so the mismatch is not checked here.
    rows = metric_rows(tmp_path / "runs" / "lora")
    _check(rows, exact=False)
    for r in rows:
        # the ledger balances, and each step trained its two groups
        states = sum(r[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped"))
        assert r["ledger/produced"] == states, r
        assert r["ledger/trained"] == 2 * r["step"], r
