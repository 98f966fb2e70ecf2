"""LoRA composed with the FSDP2 backend: only the adapter trains and is exported for sync, the
trainer's log-probs are the peft model's, the exports load in peft and transformers, resume is
bitwise, and two ranks train as one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build
from miles_lora.adapter import build as build_lora
from miles_lora.options import LoraOptions

from miles_core.contracts import AdapterTrainer

OPTIONS = FSDP2Options(
    lr=2e-2,
    weight_decay=0.1,
    warmup_steps=1,
    lr_schedule="cosine",
    decay_steps=6,
    min_lr_ratio=0.1,
    micro_batch_tokens=30,
    cpu_threads=1,
)
LORA = LoraOptions(rank=4, alpha=8)


def _algo():
    return build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))


def _trained(llama_path: str, groups, options: FSDP2Options = OPTIONS, steps: int = 2):
    trainer = build(options, build_lora(LORA))
    trainer.setup(llama_path)
    g = groups(seed=11)
    algo = _algo()
    metrics = [trainer.train_step(g, algo) for _ in range(steps)]
    return trainer, g, metrics


def _base_state(trainer) -> dict[str, torch.Tensor]:
    return {
        n: v.detach().clone()
        for n, v in trainer._local.model.state_dict().items()
        if ".lora_" not in n
    }


def test_only_the_adapter_trains_and_is_exported(llama_path: str, groups, hf) -> None:
    trainer = build(OPTIONS, build_lora(LORA))
    trainer.setup(llama_path)
    assert isinstance(trainer, AdapterTrainer)
    before_base = _base_state(trainer)
    before = dict(trainer.export_weights())
    g = groups(seed=11)
    algo = _algo()
    m1 = trainer.train_step(g, algo)
    m2 = trainer.train_step(g, algo)
    assert m1["kl_ref"] == 0.0 and m2["kl_ref"] > 0.0  # the reference: adapter disabled
    after = dict(trainer.export_weights())
    # the stream holds the adapter alone, in PEFT's names
    assert set(after) == set(before)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in after)
    assert all(n.startswith("base_model.model.model.layers.") for n in after)
    assert len(after) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert any(not torch.equal(after[n], before[n]) for n in after)
    assert any(after[n].any() for n in after if ".lora_B." in n)  # B moved off zero
    # the base: bit for bit what it was
    for n, v in _base_state(trainer).items():
        assert torch.equal(v, before_base[n]), n
    # a fraction of the whole model's numbers and bytes
    full = hf.model(llama_path).state_dict()
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    lora_bytes = sum(t.numel() * t.element_size() for t in after.values())
    assert len(after) > 0 and lora_bytes < full_bytes / 4
    trainer.close()


def test_logprobs_equal_a_peft_merged_model(llama_path: str, groups, hf, tmp_path) -> None:
    from peft import PeftModel

    trainer, g, _ = _trained(llama_path, groups)
    lp, _ = trainer.compute_logprobs(g)
    # the trained adapter, saved in PEFT's format, loaded by peft on the plain checkpoint
    trainer.save_adapter(str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    peft_model = PeftModel.from_pretrained(hf.model(llama_path), str(tmp_path / "adapter"))
    peft_model.eval()
    torch.testing.assert_close(lp, hf.logprobs(peft_model, g), atol=1e-5, rtol=0)
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(lp, hf.logprobs(merged, g), atol=1e-5, rtol=0)
    # the merged export: a plain transformers checkpoint with the same log-probs
    from miles_core.runtime.export import export_checkpoint

    export_checkpoint(trainer.export_model(), Path(llama_path), tmp_path / "m")
    plain = hf.model(str(tmp_path / "m"))
    torch.testing.assert_close(lp, hf.logprobs(plain, g), atol=1e-5, rtol=0)
    assert (lp - hf.logprobs(hf.model(llama_path), g)).abs().max() > 1e-4  # it did train
    trainer.close()


def test_resume_is_bitwise_and_the_checkpoint_holds_no_base(llama_path: str, groups, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    first, g, _ = _trained(llama_path, groups)
    saved = first.fingerprint()
    ckpt = str(tmp_path / "ckpt")
    first.save(ckpt, extra={"data_position": 3})
    keys = set(FileSystemReader(os.path.join(ckpt, "sharded")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:3]
    third = first.train_step(g, _algo())
    expected = first.fingerprint()
    first.close()

    torch.manual_seed(1234)
    resumed = build(OPTIONS, build_lora(LORA))
    resumed.setup(llama_path)
    assert resumed.fingerprint() != saved
    resumed.load(ckpt)
    assert resumed.fingerprint() == saved and resumed.extra == {"data_position": 3}
    again = resumed.train_step(g, _algo())
    assert resumed.fingerprint() == expected
    assert again["loss"] == third["loss"] and again["grad_norm"] == third["grad_norm"]
    resumed.close()

    other = build(OPTIONS, build_lora(LoraOptions(rank=8)))
    other.setup(llama_path)
    with pytest.raises(ValueError, match="resumes only with the adapter"):
        other.load(ckpt)
    other.close()


def test_bf16_trains_the_adapter_alone(llama_path: str, groups) -> None:
    trainer = build(OPTIONS.model_copy(update={"precision": "bf16"}), build_lora(LORA))
    trainer.setup(llama_path)
    base = _base_state(trainer)
    g = groups(seed=11)
    for _ in range(2):
        metrics = trainer.train_step(g, _algo())
        assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    for n, v in _base_state(trainer).items():
        assert torch.equal(v, base[n]), n
    assert any(t.any() for n, t in trainer.export_weights() if ".lora_B." in n)
    trainer.close()


def test_dropout_is_refused_by_fsdp2(llama_path: str) -> None:
    trainer = build(OPTIONS, build_lora(LoraOptions(dropout=0.1)))
    with pytest.raises(ValueError, match=r"adapter.dropout 0.1: the fsdp2 backend runs"):
        trainer.setup(llama_path)


def test_an_unmatched_pattern_fails_setup(llama_path: str) -> None:
    trainer = build(OPTIONS, build_lora(LoraOptions(target_modules=["c_attn"])))
    with pytest.raises(ValueError, match="'c_attn' matches no module"):
        trainer.setup(llama_path)


@pytest.mark.slow
def test_two_ranks_equal_one(llama_path: str, groups, tmp_path) -> None:
    one, _, m_one = _trained(llama_path, groups)
    two, _, m_two = _trained(llama_path, groups, OPTIONS.model_copy(update={"world_size": 2}))
    for a, b in zip(m_one, m_two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    w1, w2 = dict(one.export_weights()), dict(two.export_weights())
    assert set(w1) == set(w2)
    for n in w1:
        torch.testing.assert_close(w1[n], w2[n], atol=1e-6, rtol=1e-5)
    m1, m2 = dict(one.export_model()), dict(two.export_model())
    assert set(m1) == set(m2)
    for n in m1:
        torch.testing.assert_close(m1[n], m2[n], atol=1e-6, rtol=1e-5)
    two.save_adapter(str(tmp_path / "a2"))
    assert (tmp_path / "a2" / "adapter_model.safetensors").exists()
    ckpt = str(tmp_path / "ckpt2")
    two.save(ckpt)
    fp = two.fingerprint()
    two.close()
    again = build(OPTIONS.model_copy(update={"world_size": 2}), build_lora(LORA))
    again.setup(llama_path)
    again.load(ckpt)
    assert again.fingerprint() == fp
    again.close()
    one.close()


def test_run_export_writes_the_merged_model_and_the_adapter(
    llama_path: str, groups, hf, tmp_path
) -> None:
    from types import SimpleNamespace

    from peft import PeftModel

    from miles_core.runtime.export import export_policy
    from miles_core.runtime.policy import Policy

    trainer, g, _ = _trained(llama_path, groups)
    lp, _ = trainer.compute_logprobs(g)
    config = SimpleNamespace(adapter=SimpleNamespace(name="lora"), adapters=[])
    out = export_policy(Policy(trainer), llama_path, tmp_path, config)  # type: ignore[arg-type]
    assert out == {"model": str(tmp_path / "model"), "adapter": str(tmp_path / "adapter")}
    assert (tmp_path / "model" / "config.json").exists()
    torch.testing.assert_close(hf.logprobs(hf.model(out["model"]), g), lp, atol=1e-5, rtol=0)
    loaded = PeftModel.from_pretrained(hf.model(llama_path), out["adapter"])
    loaded.eval()
    torch.testing.assert_close(hf.logprobs(loaded, g), lp, atol=1e-5, rtol=0)
    trainer.close()
