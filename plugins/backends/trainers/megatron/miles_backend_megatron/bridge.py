"""Hugging Face <-> Megatron-core: the model's shape from a Hugging Face config, and the
weight mapping both ways, sharded for tensor parallelism.

``megatron-bridge`` would do this mapping, but it cannot be used here (see the plugin README):
so the mapping is written out for the two families this backend builds, Llama (SmolLM2, tied
embeddings) and Qwen3 dense (QK-norm). Every conversion is a reshape, split or concatenation,
so Hugging Face -> Megatron -> Hugging Face is bitwise.

Megatron layouts (per decoder layer):

* ``linear_qkv.weight``: the query heads of a key/value group, then its key, then its value,
  group after group: ``[groups * (heads_per_group + 2) * head_dim, hidden]``. Column parallel:
  rank ``r`` of ``tp`` holds groups ``r * groups/tp ...`` (a contiguous block).
* ``linear_fc1.weight``: gate then up, ``[2 * ffn, hidden]``; column parallel with each rank
  holding ``[gate_r; up_r]``.
* ``linear_proj.weight`` and ``linear_fc2.weight``: row parallel (split along the input).
* ``word_embeddings.weight`` and ``output_layer.weight``: split along the vocabulary.
* norms (``input_layernorm``, ``pre_mlp_layernorm``, ``q/k_layernorm``, ``final_layernorm``):
  whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from miles_backend_megatron.lora import lora_split
from miles_backend_megatron.shape import ModelShape

# --- the layer's tensors ----------------------------------------------------------------------

#: How each Megatron tensor is split across tensor-parallel ranks (by name suffix).
SPLIT = {
    "self_attention.linear_qkv.weight": "column",
    "self_attention.linear_proj.weight": "row",
    "mlp.linear_fc1.weight": "gate_up",
    "mlp.linear_fc2.weight": "row",
    "embedding.word_embeddings.weight": "column",
    "output_layer.weight": "column",
}


def split_of(name: str) -> str:
    """``column``, ``row``, ``gate_up`` or ``replicated`` for a Megatron parameter name (a
    LoRA branch's A or B included: :func:`miles_backend_megatron.lora.lora_split`)."""
    lora = lora_split(name)
    if lora is not None:
        return lora
    for suffix, kind in SPLIT.items():
        if name.endswith(suffix):
            return kind
    return "replicated"


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape) -> Tensor:
    """Hugging Face q/k/v projections -> Megatron's grouped ``linear_qkv`` (whole)."""
    g, d, hidden = shape.groups, shape.head_dim, q.shape[1]
    qg = q.reshape(g, shape.heads_per_group * d, hidden)
    return torch.cat([qg, k.reshape(g, d, hidden), v.reshape(g, d, hidden)], dim=1).reshape(
        -1, hidden
    )


def unfuse_qkv(qkv: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    g, d, hidden = shape.groups, shape.head_dim, qkv.shape[1]
    per = shape.heads_per_group * d
    grouped = qkv.reshape(g, per + 2 * d, hidden)
    q = grouped[:, :per].reshape(-1, hidden)
    k = grouped[:, per : per + d].reshape(-1, hidden)
    v = grouped[:, per + d :].reshape(-1, hidden)
    return q.contiguous(), k.contiguous(), v.contiguous()


def shard(full: Tensor, kind: str, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s part of the whole Megatron tensor ``full``."""
    if kind == "replicated" or size == 1:
        return full.clone()
    if kind == "column":
        return full.chunk(size, dim=0)[rank].clone()
    if kind == "row":
        return full.chunk(size, dim=1)[rank].clone()
    if kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    raise ValueError(f"unknown split {kind!r}")


def unshard(parts: list[Tensor], kind: str) -> Tensor:
    """The whole Megatron tensor from every rank's part (in rank order)."""
    if kind == "replicated" or len(parts) == 1:
        return parts[0]
    if kind == "column":
        return torch.cat(parts, dim=0)
    if kind == "row":
        return torch.cat(parts, dim=1)
    if kind == "gate_up":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    raise ValueError(f"unknown split {kind!r}")


# --- whole-model name mapping -------------------------------------------------------------------


def hf_layer_names(i: int, shape: ModelShape) -> list[str]:
    """The Hugging Face tensors of decoder layer ``i``, in state-dict order."""
    p = f"model.layers.{i}."
    names = [
        p + "self_attn.q_proj.weight",
        p + "self_attn.k_proj.weight",
        p + "self_attn.v_proj.weight",
        p + "self_attn.o_proj.weight",
    ]
    if shape.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    names += [
        p + "mlp.gate_proj.weight",
        p + "mlp.up_proj.weight",
        p + "mlp.down_proj.weight",
        p + "input_layernorm.weight",
        p + "post_attention_layernorm.weight",
    ]
    return names


def megatron_layer(
    hf: Callable[[str], Tensor], i: int, local: int, shape: ModelShape
) -> dict[str, Tensor]:
    """Whole Megatron tensors of layer ``i`` (named as local layer ``local``) from the
    Hugging Face tensors ``hf(name)``."""
    p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
    out = {
        m + "input_layernorm.weight": hf(p + "input_layernorm.weight"),
        m + "self_attention.linear_qkv.weight": fuse_qkv(
            hf(p + "self_attn.q_proj.weight"),
            hf(p + "self_attn.k_proj.weight"),
            hf(p + "self_attn.v_proj.weight"),
            shape,
        ),
        m + "self_attention.linear_proj.weight": hf(p + "self_attn.o_proj.weight"),
        m + "pre_mlp_layernorm.weight": hf(p + "post_attention_layernorm.weight"),
        m + "mlp.linear_fc1.weight": torch.cat(
            [hf(p + "mlp.gate_proj.weight"), hf(p + "mlp.up_proj.weight")]
        ),
        m + "mlp.linear_fc2.weight": hf(p + "mlp.down_proj.weight"),
    }
    if shape.qk_norm:
        out[m + "self_attention.q_layernorm.weight"] = hf(p + "self_attn.q_norm.weight")
        out[m + "self_attention.k_layernorm.weight"] = hf(p + "self_attn.k_norm.weight")
    return out


def hf_layer(
    meg: Callable[[str], Tensor], i: int, local: int, shape: ModelShape
) -> dict[str, Tensor]:
    """Inverse of :func:`megatron_layer`: Hugging Face tensors of layer ``i`` from the whole
    Megatron tensors ``meg(name)`` of local layer ``local``."""
    p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
    q, k, v = unfuse_qkv(meg(m + "self_attention.linear_qkv.weight"), shape)
    gate, up = meg(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
    out = {
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": meg(m + "self_attention.linear_proj.weight"),
        p + "mlp.gate_proj.weight": gate.contiguous(),
        p + "mlp.up_proj.weight": up.contiguous(),
        p + "mlp.down_proj.weight": meg(m + "mlp.linear_fc2.weight"),
        p + "input_layernorm.weight": meg(m + "input_layernorm.weight"),
        p + "post_attention_layernorm.weight": meg(m + "pre_mlp_layernorm.weight"),
    }
    if shape.qk_norm:
        out[p + "self_attn.q_norm.weight"] = meg(m + "self_attention.q_layernorm.weight")
        out[p + "self_attn.k_norm.weight"] = meg(m + "self_attention.k_layernorm.weight")
    return {name: out[name] for name in hf_layer_names(i, shape)}


def stage_layers(shape: ModelShape, pp_rank: int, pp: int) -> range:
    """The global decoder layers pipeline stage ``pp_rank`` of ``pp`` holds."""
    per = shape.layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def megatron_stage(
    hf: Callable[[str], Tensor],
    shape: ModelShape,
    pp_rank: int = 0,
    pp: int = 1,
    *,
    vocab_head: bool = True,
) -> dict[str, Tensor]:
    """Whole (not tensor-sharded) Megatron state dict of one pipeline stage (without the
    last stage's ``output_layer`` when not ``vocab_head``: a critic's body)."""
    out: dict[str, Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = hf("model.embed_tokens.weight")
    for local, i in enumerate(stage_layers(shape, pp_rank, pp)):
        out.update(megatron_layer(hf, i, local, shape))
    if last:
        out["decoder.final_layernorm.weight"] = hf("model.norm.weight")
    if last and vocab_head:
        if not shape.tied:
            out["output_layer.weight"] = hf("lm_head.weight")
        elif pp > 1:
            # The last stage keeps its own copy of the tied embedding (Megatron's layout): the
            # backend keeps both copies equal by summing their gradients.
            out["output_layer.weight"] = hf("model.embed_tokens.weight")
    return out


def hf_names(shape: ModelShape) -> list[str]:
    """Every tensor of the Hugging Face model's state dict, in its order; ``lm_head.weight``
    is there with tied embeddings too (the same tensor as the embedding), as Hugging Face's
    ``state_dict()`` lists it and the engines accept it."""
    names = ["model.embed_tokens.weight"]
    for i in range(shape.layers):
        names += hf_layer_names(i, shape)
    return [*names, "model.norm.weight", "lm_head.weight"]


def stage_hf_names(shape: ModelShape, pp_rank: int = 0, pp: int = 1) -> list[str]:
    """The Hugging Face tensors :func:`hf_stage` yields for stage ``pp_rank``, in order (a
    tied ``lm_head.weight`` left out: it is the embedding, exported once under its name, as
    FSDP2's export and Hugging Face's ``save_pretrained`` do)."""
    names = ["model.embed_tokens.weight"] if pp_rank == 0 else []
    for i in stage_layers(shape, pp_rank, pp):
        names += hf_layer_names(i, shape)
    if pp_rank == pp - 1:
        names += ["model.norm.weight"] + ([] if shape.tied else ["lm_head.weight"])
    return names


def hf_stage(
    meg: Callable[[str], Tensor], shape: ModelShape, pp_rank: int = 0, pp: int = 1
) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face tensors of one stage from its whole Megatron tensors ``meg(name)``."""
    if pp_rank == 0:
        yield "model.embed_tokens.weight", meg("embedding.word_embeddings.weight")
    for local, i in enumerate(stage_layers(shape, pp_rank, pp)):
        yield from hf_layer(meg, i, local, shape).items()
    if pp_rank == pp - 1:
        yield "model.norm.weight", meg("decoder.final_layernorm.weight")
        if not shape.tied:  # a tied head is the embedding: sent once, under its name
            yield "lm_head.weight", meg("output_layer.weight")
