"""The Hugging Face <-> Megatron mapping: bitwise round trips, tensor-parallel splits, the
model's logits against Hugging Face's own, and the checks that refuse a model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from miles_backend_megatron.bridge import (
    hf_names,
    hf_stage,
    megatron_stage,
    shard,
    split_of,
    unshard,
)
from miles_backend_megatron.shape import (
    ModelShape,
    ModelShapeError,
    check_checkpoint,
    safetensors_shapes,
)


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_round_trip_is_bitwise_at_every_split(model_path: str) -> None:
    shape = ModelShape.from_path(model_path)
    hf = _hf_state(model_path)
    whole = megatron_stage(hf.__getitem__, shape)
    back = dict(hf_stage(whole.__getitem__, shape))
    assert hf_names(shape) == list(hf)
    # a tied head is the embedding: exported once, under the embedding's name
    tied = ["lm_head.weight"] if shape.tied else []
    assert list(back) == [n for n in hf if n not in tied]
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    # Split for 2 tensor-parallel ranks and put back together: the same bytes.
    for name, tensor in whole.items():
        parts = [shard(tensor, split_of(name), r, 2) for r in range(2)]
        if split_of(name) != "replicated":
            assert all(p.numel() * 2 == tensor.numel() for p in parts), name
        assert torch.equal(unshard(parts, split_of(name)), tensor), name


def test_two_stages_hold_every_tensor_once(model_path: str) -> None:
    shape = ModelShape.from_path(model_path)
    hf = _hf_state(model_path)
    names: list[str] = []
    for stage in range(2):
        whole = megatron_stage(hf.__getitem__, shape, stage, 2)
        names += [n for n, _ in hf_stage(whole.__getitem__, shape, stage, 2)]
    tied = ["lm_head.weight"] if shape.tied else []
    assert sorted(names) == sorted(n for n in hf if n not in tied)


def test_qkv_layout_groups_queries_with_their_key_and_value() -> None:
    """Megatron's fused QKV: group g holds its query heads, then its key, then its value."""
    from miles_backend_megatron.bridge import fuse_qkv

    shape = ModelShape.from_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 1,
            "hidden_size": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 1,
            "intermediate_size": 2,
            "vocab_size": 4,
        }
    )
    q = torch.tensor([[0.0, 0], [1, 1], [2, 2], [3, 3]])
    k = torch.tensor([[10.0, 10], [11, 11]])
    v = torch.tensor([[20.0, 20], [21, 21]])
    rows = fuse_qkv(q, k, v, shape)[:, 0].tolist()
    assert rows == [0, 1, 10, 20, 2, 3, 11, 21]


def test_logits_equal_hugging_face(model_path: str) -> None:
    from miles_backend_megatron.model import causal_mask, head, hidden_states
    from miles_backend_megatron.options import MegatronOptions
    from miles_backend_megatron.worker import RankWorker
    from transformers import AutoModelForCausalLM

    worker = RankWorker(MegatronOptions(cpu_threads=1), 0, 1)
    worker.setup(model_path)
    assert worker.model is not None
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.randint(1, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = head(worker.model, hidden_states(worker.model, ids, causal_mask(11, ids.device)))
    assert (ref - out).abs().max() < 1e-5


def _copy(path: str, tmp_path: Path, **changes: object) -> Path:
    target = tmp_path / "model"
    shutil.copytree(path, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_refusals_name_the_field_and_the_allowed_values(llama_path: str, tmp_path: Path) -> None:
    shape = ModelShape.from_path(llama_path)
    with pytest.raises(
        ModelShapeError,
        match=r"tensor_parallel=3 .*heads.*allowed tensor_parallel for this model: 1, 2",
    ):
        shape.check_parallel(3, 1)
    with pytest.raises(
        ModelShapeError, match=r"pipeline_parallel=3 .*num_hidden_layers \(2\); allowed: 1, 2"
    ):
        shape.check_parallel(1, 3)
    with pytest.raises(
        ModelShapeError,
        match=r"'GPT2LMHeadModel' is not supported.*LlamaForCausalLM, Qwen3ForCausalLM",
    ):
        ModelShape.from_config({"architectures": ["GPT2LMHeadModel"]})
    # A checkpoint whose tensors do not match its config.
    wrong = ModelShape.from_path(str(_copy(llama_path, tmp_path, intermediate_size=96)))
    with pytest.raises(
        ModelShapeError,
        match=r"gate_proj.weight' has shape \[64, 32\], but the config says \[96, 32\]",
    ):
        check_checkpoint(safetensors_shapes(llama_path), wrong)


def test_transformer_engine_names_and_refusal_on_cpu() -> None:
    """TE's spec fuses the pre-attention and pre-MLP norms into the projections: the bridge's
    names are translated to TE's; asking for TE's spec on a CPU is refused by name."""
    from miles_backend_megatron.model import check_layer_spec, resolve_layer_spec, spec_name

    te = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 0,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 0,
    }
    assert spec_name("decoder.layers.0.input_layernorm.weight", te) == next(iter(te))
    assert spec_name("decoder.layers.0.pre_mlp_layernorm.weight", te) == list(te)[1]
    local = {"decoder.layers.0.input_layernorm.weight": 0}
    assert spec_name("decoder.layers.0.input_layernorm.weight", local) == next(iter(local))
    assert resolve_layer_spec("auto", torch.device("cpu")) == "local"
    with pytest.raises(ValueError, match=r"needs device 'cuda'.*allowed on CPU: 'local'"):
        check_layer_spec("transformer_engine", torch.device("cpu"))
