"""The model's shape from a Hugging Face config, and the checks that refuse a model or a
split this backend cannot build (torch-free: run when a config is validated)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Hugging Face architectures this backend builds, and what each adds to the Llama layout.
ARCHITECTURES = {"LlamaForCausalLM": {"qk_norm": False}, "Qwen3ForCausalLM": {"qk_norm": True}}
#: Value models (Hugging Face token classification, one label: the same body, a ``score`` head
#: in place of ``lm_head``) this backend builds as a critic, and the causal layout of each.
VALUE_ARCHITECTURES = {
    "LlamaForTokenClassification": "LlamaForCausalLM",
    "Qwen3ForTokenClassification": "Qwen3ForCausalLM",
}


class ModelShapeError(ValueError):
    """A config or checkpoint this backend cannot build or shard (the message names the field
    and what is allowed)."""


@dataclass(frozen=True)
class ModelShape:
    """What the Megatron model needs from a Hugging Face config."""

    architecture: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    tied: bool
    qk_norm: bool
    max_positions: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, value: bool = False) -> ModelShape:
        """Read a Hugging Face ``config.json`` (as a dict); raises :class:`ModelShapeError` for
        an architecture or feature the mapping does not cover. ``value``: a critic's body,
        which may also be a value model of a supported family (:data:`VALUE_ARCHITECTURES`)."""
        arch = (config.get("architectures") or ["?"])[0]
        if value:
            arch = VALUE_ARCHITECTURES.get(arch, arch)
        if arch not in ARCHITECTURES:
            raise ModelShapeError(
                f"model architecture {arch!r} is not supported by the megatron backend; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ModelShapeError(
                    f"config {flag}=true is not supported by the megatron backend's mapping "
                    "(allowed: false)"
                )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelShapeError(f"hidden_act {act!r} is not supported (allowed: 'silu')")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelShapeError(
                f"rope_type {rope_type!r} is not supported by the megatron backend "
                "(allowed: 'default')"
            )
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % groups:
            raise ModelShapeError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({groups})"
            )
        return cls(
            architecture=arch,
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            groups=groups,
            head_dim=head_dim,
            ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=bool(ARCHITECTURES[arch]["qk_norm"]),
            max_positions=int(config.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_path(cls, model_path: str, *, value: bool = False) -> ModelShape:
        """:meth:`from_config` of ``model_path/config.json``."""
        path = os.path.join(os.path.expanduser(model_path), "config.json")
        if not os.path.isfile(path):
            raise ModelShapeError(f"{model_path} holds no config.json (a Hugging Face folder)")
        with open(path) as f:
            return cls.from_config(json.load(f), value=value)

    def check_parallel(self, tensor_parallel: int, pipeline_parallel: int) -> None:
        """Refuse a split this model cannot take, naming the option and the allowed values."""

        def divisors(n: int) -> str:
            return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

        tp, pp = tensor_parallel, pipeline_parallel
        for what, n in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.groups),
            ("vocab_size", self.vocab),
            ("intermediate_size", self.ffn),
        ):
            if n % tp:
                raise ModelShapeError(
                    f"tensor_parallel={tp} does not divide the model's {what} ({n}); "
                    f"allowed tensor_parallel for this model: {divisors(_common(self))}"
                )
        if self.layers % pp:
            raise ModelShapeError(
                f"pipeline_parallel={pp} does not divide the model's num_hidden_layers "
                f"({self.layers}); allowed: {divisors(self.layers)}"
            )


def _common(shape: ModelShape) -> int:
    import math

    return math.gcd(math.gcd(shape.heads, shape.groups), math.gcd(shape.vocab, shape.ffn))


def hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model (``lm_head.weight`` included) and its shape."""
    h, d = shape.hidden, shape.head_dim
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        want.update(
            {
                p + "self_attn.q_proj.weight": (shape.heads * d, h),
                p + "self_attn.k_proj.weight": (shape.groups * d, h),
                p + "self_attn.v_proj.weight": (shape.groups * d, h),
                p + "self_attn.o_proj.weight": (h, shape.heads * d),
                p + "mlp.gate_proj.weight": (shape.ffn, h),
                p + "mlp.up_proj.weight": (shape.ffn, h),
                p + "mlp.down_proj.weight": (h, shape.ffn),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if shape.qk_norm:
            want[p + "self_attn.q_norm.weight"] = (d,)
            want[p + "self_attn.k_norm.weight"] = (d,)
    want["model.norm.weight"] = (h,)
    want["lm_head.weight"] = (shape.vocab, h)
    return want


def check_checkpoint(
    tensors: Mapping[str, tuple[int, ...]], shape: ModelShape, *, value: bool = False
) -> None:
    """Refuse a checkpoint whose tensor names or shapes do not match its config: every
    expected tensor present with its expected shape (a tied head may be absent: Hugging
    Face saves the embedding only; ``value``: a critic's body needs no vocabulary head)."""
    want = hf_shapes(shape)
    if (shape.tied or value) and "lm_head.weight" not in tensors:
        del want["lm_head.weight"]
    for name, expected in want.items():
        if name not in tensors:
            raise ModelShapeError(f"the checkpoint has no tensor {name!r}, which its config needs")
        got = tuple(tensors[name])
        if got != expected:
            raise ModelShapeError(
                f"checkpoint tensor {name!r} has shape {list(got)}, but the config says "
                f"{list(expected)}"
            )


def safetensors_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the ``*.safetensors`` files of ``model_path``, read from the
    files' JSON headers (no tensor data is read)."""
    folder = os.path.expanduser(model_path)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelShapeError(f"{model_path} holds no *.safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, value in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(value["shape"])
    return shapes
