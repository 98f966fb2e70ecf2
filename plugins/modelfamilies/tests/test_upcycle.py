"""Sparse upcycling of a dense Llama into a Mixtral MoE: with unperturbed experts the MoE
computes the dense model's logits; the perturbation is seeded and makes the experts differ;
the folder is a normal Hugging Face checkpoint with the dense model's tokenizer files; a dense
model Mixtral cannot reproduce is refused naming the field. On the shipped SmolLM2-135M-Instruct,
through the documented command: the same logits and greedy answers, and the smollm2 family's
engine gate passes on the upcycled model served by the embedded engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama with tied embeddings and a tokenizer-like extra file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "tokenizer.json").write_text('{"stand": "in"}')
    return path


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_unperturbed_upcycling_keeps_the_dense_function(tmp_path: Path) -> None:
    from miles_modelfamilies.upcycle import upcycle

    dense_path = tiny_llama(tmp_path / "dense")
    out = upcycle(dense_path, tmp_path / "moe", experts=4, top_k=2, noise=0.0)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert (out / "tokenizer.json").read_text() == '{"stand": "in"}'
    dense, moe = load(dense_path), load(out)
    mlp = dense.model.layers[1].mlp
    experts = moe.model.layers[1].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 128, 32)
    for e in range(4):
        assert torch.equal(experts.gate_up_proj[e, :64], mlp.gate_proj.weight)
        assert torch.equal(experts.down_proj[e], mlp.down_proj.weight)
    ids = torch.randint(0, 100, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (dense(ids).logits - moe(ids).logits).abs().max().item()
    assert gap < 1e-5, gap


def test_perturbed_experts_differ_and_the_noise_is_seeded(tmp_path: Path) -> None:
    from miles_modelfamilies.upcycle import upcycle

    dense_path = tiny_llama(tmp_path / "dense")
    a = load(upcycle(dense_path, tmp_path / "a", noise=0.01, seed=3))
    b = load(upcycle(dense_path, tmp_path / "b", noise=0.01, seed=3))
    c = load(upcycle(dense_path, tmp_path / "c", noise=0.01, seed=4))
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name]), name
    assert not torch.equal(a.model.layers[0].mlp.gate.weight, c.model.layers[0].mlp.gate.weight)
    w = a.model.layers[0].mlp.experts.down_proj
    base = load(dense_path).model.layers[0].mlp.down_proj.weight
    for e in range(4):
        rel = float((w[e] - base).detach().std() / base.detach().std())
        assert 0.005 < rel < 0.02, rel  # noise x the weight's std
    assert not torch.equal(w[0], w[1])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_type", "qwen3", "model_type: 'qwen3' is not upcycled; allowed: 'llama'"),
        ("mlp_bias", True, "mlp_bias: Mixtral has no biases"),
        ("attention_bias", True, "attention_bias: Mixtral has no biases"),
    ],
)
def test_a_dense_model_mixtral_cannot_reproduce_is_refused(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    from miles_modelfamilies.upcycle import upcycle

    dense_path = tiny_llama(tmp_path / "dense")
    config = json.loads((dense_path / "config.json").read_text())
    config[field] = value
    (dense_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        upcycle(dense_path, tmp_path / "moe")
    with pytest.raises(ValueError, match=r"top_k: 5 must be in 1\.\.experts"):
        upcycle(tiny_llama(tmp_path / "d2"), tmp_path / "moe", experts=4, top_k=5)


@pytest.fixture(scope="module")
def smollm2_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the dense SmolLM2 folder, its unperturbed upcycling by the documented command)."""
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    dense = smollm2_model_folder()
    out = tmp_path_factory.mktemp("upcycled") / "smollm2-moe"
    cmd = [sys.executable, "-m", "miles_modelfamilies.upcycle", "--experts", "4", "--top-k", "2"]
    done = subprocess.run(
        [*cmd, "--noise", "0", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(out)
    return dense, out


@pytest.mark.slow
def test_upcycled_smollm2_computes_the_dense_model(smollm2_moe: tuple[Path, Path]) -> None:
    """30 layers of float32: the top-2 weights sum to 1 up to one rounding (the router runs in
    float32), so the logits agree to a few parts in a million of their scale, and the greedy
    answers are the same."""
    dense_path, moe_path = smollm2_moe
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (moe_path / name).read_bytes() == (dense_path / name).read_bytes(), name
    torch.set_num_threads(2)
    dense, moe = load(dense_path), load(moe_path)
    assert type(moe).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = dense(ids).logits, moe(ids).logits
    gap = (a - b).abs().max().item()
    assert gap < 1e-5 * a.abs().max().item(), gap
    prompt = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 47, 2]])
    greedy = [
        m.generate(prompt, max_new_tokens=12, do_sample=False)[0].tolist() for m in (dense, moe)
    ]
    assert greedy[0] == greedy[1]
