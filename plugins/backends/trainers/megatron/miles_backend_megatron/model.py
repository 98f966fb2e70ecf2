"""Building Megatron-core's ``GPTModel`` for a Hugging Face model, loading its weights, and
the forward pieces.

The model is built from :class:`~miles_backend_megatron.shape.ModelShape` with Megatron's
local layer spec (or Transformer Engine's, on a GPU, when asked for), dropout off, and loaded
from the Hugging Face safetensors through the bridge's mapping: each rank reads only the
tensors of its pipeline stage and keeps its tensor-parallel part.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles_backend_megatron.bridge import megatron_stage, shard, split_of
from miles_backend_megatron.shape import ModelShape, check_checkpoint

#: Transformer Engine's spec fuses the norm before the QKV and fc1 projections into them.
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def spec_name(name: str, params: Any) -> str:
    """The model's own name for the local-spec parameter ``name`` (the bridge's naming):
    ``name`` itself, or Transformer Engine's fused-norm name when the model has that."""
    if name in params:
        return name
    for local, fused in _TE_NAMES.items():
        if name.endswith(local):
            return name[: -len(local)] + fused
    return name


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_layer_spec(layer_spec: str, device: torch.device) -> str:
    """``auto``: Transformer Engine's spec on a GPU where TE is installed, else ``local``."""
    if layer_spec == "auto":
        return (
            "transformer_engine"
            if device.type == "cuda" and _have_transformer_engine()
            else "local"
        )
    return layer_spec


def check_layer_spec(layer_spec: str, device: torch.device) -> None:
    """Refuse Transformer Engine's spec where it cannot run."""
    if layer_spec != "transformer_engine":
        return
    if device.type != "cuda":
        raise ValueError(
            "layer_spec 'transformer_engine' needs device 'cuda' (allowed on CPU: 'local')"
        )
    if not _have_transformer_engine():
        raise ValueError(
            "layer_spec 'transformer_engine' needs Transformer Engine installed "
            "(pip install transformer-engine[pytorch]); or use layer_spec 'local'"
        )


def transformer_config(shape: ModelShape, tp: int, pp: int, *, bf16: bool = False) -> Any:
    """Megatron's ``TransformerConfig`` for ``shape``: the Llama/Qwen3 block (RMSNorm, SwiGLU,
    RoPE, grouped-query attention, no biases), dropout off, no fusions that need CUDA."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.eps,
        qk_layernorm=shape.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        params_dtype=torch.float32,
        bf16=bf16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def build_model(
    shape: ModelShape,
    tp: int,
    pp: int,
    pp_rank: int,
    device: torch.device,
    layer_spec: str = "auto",
    *,
    invariant: bool = False,
) -> nn.Module:
    """The ``GPTModel`` of pipeline stage ``pp_rank`` (weights uninitialised: load them).
    ``invariant``: true on-policy mode's modules (:mod:`miles_backend_megatron.invariant`,
    one tensor-parallel rank, the local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    layer_spec = resolve_layer_spec(layer_spec, device)
    check_layer_spec(layer_spec, device)
    if layer_spec == "transformer_engine":
        from megatron.core.transformer.enums import AttnMaskType

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
        # The backend passes its own masks (causal, or the shared-prompt blocks).
        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    config = transformer_config(shape, tp, pp)
    if invariant:
        from miles_backend_megatron.invariant import block_spec

        if tp != 1 or layer_spec != "local":
            raise ValueError("true on-policy mode needs tensor_parallel 1 and the local spec")
        spec = block_spec(config, shape.qk_norm, pp_rank)
    model = GPTModel(
        config,
        spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.max_positions,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=shape.tied and pp == 1,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta)
        if float(shape.rope_theta).is_integer()
        else shape.rope_theta,
        parallel_output=True,
    )
    # Dropout is off in the config; eval mode keeps any other train-only behaviour off too, so
    # the log-probs a gradient is taken at equal the recomputed ones.
    model.eval()
    return model.to(device)


def hf_reader(model_path: str) -> tuple[Callable[[str], Tensor], dict[str, tuple[int, ...]]]:
    """A reader of the Hugging Face safetensors of ``model_path`` (one tensor at a time, as
    float32 on the CPU; each file opened once) and every tensor's shape."""
    from safetensors import safe_open

    folder = os.path.expanduser(model_path)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_path} holds no *.safetensors file")
    where: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        handle = safe_open(path, framework="pt")
        for name in handle.keys():
            where[name] = handle
            shapes[name] = tuple(handle.get_slice(name).get_shape())

    def read(name: str) -> Tensor:
        if name == "lm_head.weight" and name not in where:
            name = "model.embed_tokens.weight"  # tied: Hugging Face saves the embedding only
        return where[name].get_tensor(name).to(torch.float32)

    return read, shapes


def load_weights(
    model: nn.Module,
    model_path: str,
    shape: ModelShape,
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
    *,
    value: bool = False,
) -> None:
    """Fill ``model`` (stage ``pp_rank``, tensor-parallel rank ``tp_rank``) from the Hugging
    Face checkpoint; raises when a tensor is missing or mis-shaped. ``value``: a critic's
    body (no vocabulary head read; the checkpoint may be a value model)."""
    read, shapes = hf_reader(model_path)
    check_checkpoint(shapes, shape, value=value)
    params = dict(model.named_parameters())
    stage = megatron_stage(read, shape, pp_rank, pp, vocab_head=not value)
    whole = {spec_name(k, params): v for k, v in stage.items()}
    missing = sorted(set(params) - set(whole))
    if missing:
        raise RuntimeError(f"the mapping gives no value for Megatron parameters {missing}")
    with torch.no_grad():
        for name, param in params.items():
            part = shard(whole[name], split_of(name), tp_rank, tp)
            if tuple(part.shape) != tuple(param.shape):
                raise RuntimeError(
                    f"{name}: the mapped part has shape {list(part.shape)}, the model "
                    f"{list(param.shape)}"
                )
            param.copy_(part)


def causal_mask(length: int, device: torch.device) -> Tensor:
    """Megatron's attention mask (True = not attended) for causal attention: passed
    explicitly, as Megatron's own causal path needs CUDA kernels."""
    return torch.ones(1, 1, length, length, dtype=torch.bool, device=device).triu(1)


def rotary_at(model: nn.Module, position: Tensor) -> Tensor:
    """Megatron's rotary frequencies ``[s, b, 1, d]`` for per-token ``position`` ids ``[b, s]``
    (its own ``rotary_pos_emb(s)`` gives positions ``0..s-1`` for every row): the same
    formula, ``cat(p * inv_freq, p * inv_freq)``, which its unfused rotary path broadcasts over
    the batch."""
    inv_freq = _unwrap(model).rotary_pos_emb.inv_freq.to(position.device)
    freqs = position.to(inv_freq.dtype)[..., None] * inv_freq
    return torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]


def hidden_states(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    input_tensor: Tensor | None = None,
    position: Tensor | None = None,
) -> Tensor:
    """This stage's decoder output ``[s, b, h]`` (after the final norm on the last stage):
    from the token ids on the first stage, from ``input_tensor`` (the previous stage's output)
    on the others. ``position`` ``[b, s]``: per-token position ids (default ``0..s-1``)."""
    length = ids.shape[1]
    inner = _unwrap(model)
    rotary = inner.rotary_pos_emb(length) if position is None else rotary_at(model, position)
    if inner.pre_process:
        if position is None:
            position = torch.arange(length, device=ids.device)[None, :].expand_as(ids)
        x = inner.embedding(input_ids=ids, position_ids=position)
    else:
        if input_tensor is None:
            raise ValueError("a stage after the first needs the previous stage's output")
        inner.set_input_tensor(input_tensor)
        x = None
    return inner.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary)


def head(model: nn.Module, hidden: Tensor, *, invariant: bool = False) -> Tensor:
    """Logits ``[b, s, vocab]`` of ``hidden`` ``[s, b, h]``, the whole vocabulary gathered
    from the tensor-parallel ranks; ``invariant``: as the engine's ``lm_head`` computes them
    in true on-policy mode (one rank)."""
    inner = _unwrap(model)
    weight = (
        inner.shared_embedding_or_output_weight()
        if inner.share_embeddings_and_output_weights
        else None
    )
    if invariant:
        from miles_backend_megatron.invariant import logits as invariant_logits

        return invariant_logits(hidden, inner.output_layer.weight if weight is None else weight)
    logits, _ = inner.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return logits.transpose(0, 1)


class Critic(nn.Module):
    """PPO's critic on one rank: a ``GPTModel`` stage (``body``) built and loaded like the
    policy's, without its vocabulary head, and on the last pipeline stage a value head
    ``Linear(hidden, 1)`` (``value_head``; None on the other stages) in place of it. The head
    is tiny, so every tensor-parallel rank holds all of it (the same values on every rank)."""

    def __init__(self, body: nn.Module, value_head: nn.Linear | None) -> None:
        super().__init__()
        self.body = body
        self.value_head = value_head


def drop_vocab_head(model: nn.Module) -> None:
    """Remove the last stage's vocabulary head (``output_layer``): a critic reads values, not
    logits, so it neither loads nor trains the head (nor a tied embedding's copy of it)."""
    inner = _unwrap(model)
    if getattr(inner, "output_layer", None) is not None:
        inner.output_layer = None


def value_head(
    model_path: str, hidden: int, seed: int, device: torch.device, init_std: float
) -> nn.Linear:
    """The critic's value head ``Linear(hidden, 1)``: Hugging Face's ``score.weight`` (and
    ``score.bias``) when the checkpoint is a value model that has them, else a new head drawn
    from a generator seeded with ``seed`` alone (weight ``N(0, init_std^2)``, bias 0: what
    ``AutoModelForTokenClassification`` draws for FSDP2's critic after ``manual_seed(seed)``),
    so every rank, and every build, has the same head."""
    linear = nn.Linear(hidden, 1)
    read, shapes = hf_reader(model_path)
    with torch.no_grad():
        if shapes.get("score.weight") == (1, hidden):
            linear.weight.copy_(read("score.weight"))
            bias = read("score.bias") if "score.bias" in shapes else torch.zeros(1)
            linear.bias.copy_(bias.reshape(1))
        else:
            generator = torch.Generator().manual_seed(seed)
            linear.weight.copy_(torch.randn(1, hidden, generator=generator) * init_std)
            linear.bias.zero_()
    return linear.to(device)


def init_std(model_path: str) -> float:
    """The checkpoint config's ``initializer_range`` (Hugging Face's default 0.02)."""
    import json

    with open(os.path.join(os.path.expanduser(model_path), "config.json")) as f:
        return float(json.load(f).get("initializer_range", 0.02))


def values_at(head: nn.Module, hidden: Tensor, unit: Tensor, pos: Tensor, valid: Tensor) -> Tensor:
    """The critic's values ``[b, t]`` from the last stage's ``hidden`` ``[s, rows, h]``: the
    value head at row ``unit[i]``, position ``pos[i, j]``; 0 where not ``valid``.
    Differentiable."""
    out = head(hidden).squeeze(-1).transpose(0, 1)  # [rows, s]
    picked = out[unit[:, None], pos].float()
    return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def hidden_size(model: nn.Module) -> int:
    """The width of ``model``'s hidden states (what a stage sends the next)."""
    return int(_unwrap(model).config.hidden_size)


def _unwrap(model: nn.Module) -> Any:
    return getattr(model, "module", model)
