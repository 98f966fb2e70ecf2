"""True on-policy mode on Megatron (``rollout.true_on_policy``): a layer spec whose modules
compute every operation as the embedded engine's Hugging Face forward does inside
:func:`miles_core.invariant.kernels.invariant_mode`, so the trainer's log-probs are bitwise the
engine's.

Megatron's own local modules differ from the engine's forward in three places, each replaced
here by a module of the spec (Megatron's extension point; nothing is patched):

* **Fused projections.** ``linear_qkv`` holds the query, key and value rows interleaved by
  key/value group, ``linear_fc1`` the gate and up rows stacked; the engine runs ``q_proj``,
  ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` as separate products, and a product's
  element may depend on how many columns it computes. :class:`InvariantQKV` and
  :class:`InvariantFC1` run the same separate products (:func:`kernels.linear` over the rows of
  each) and lay the results out as Megatron expects; :class:`InvariantRowLinear` runs
  ``linear_proj`` and ``linear_fc2`` through :func:`kernels.linear` too.
* **Attention.** Megatron's ``DotProductAttention`` (scores by ``baddbmm``, its own softmax) is
  replaced by :class:`InvariantAttention`: :func:`kernels.attention`, the engine's, with the
  Hugging Face scale ``head_dim ** -0.5``.
* **RMSNorm.** ``torch.nn.RMSNorm`` is replaced by :class:`HFRMSNorm`, the Llama/Qwen3
  formula (float32 mean of squares, ``rsqrt``, then the weight), for the layers' norms, the
  query/key norms and the final norm.

Rotary embeddings, SwiGLU, the residual adds and the embedding lookup are element-wise and
equal already. The spec is for one tensor-parallel rank: a row-parallel product split over
ranks is summed by an all-reduce whose order NCCL does not fix, so ``tensor_parallel > 1`` is
refused with the mode; pipeline stages hand on exact activations, and data-parallel replicas
each forward their own rows.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn

from miles_core.invariant import kernels


class HFRMSNorm(nn.Module):
    """Hugging Face's Llama/Qwen3 RMSNorm, taking Megatron's norm arguments."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class InvariantQKV(ColumnParallelLinear):
    """``linear_qkv`` as the engine's three products: the rows of each of the query, key and
    value projections (in Hugging Face's order) multiplied on their own, then interleaved by
    key/value group as Megatron's attention splits them."""

    def forward(self, x: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        c = self.config
        groups, d = c.num_query_groups, c.kv_channels
        per = c.num_attention_heads // groups
        w = (self.weight if weight is None else weight).view(groups, (per + 2) * d, -1)
        q = kernels.linear(x, w[:, : per * d].reshape(groups * per * d, -1))
        k = kernels.linear(x, w[:, per * d : (per + 1) * d].reshape(groups * d, -1))
        v = kernels.linear(x, w[:, (per + 1) * d :].reshape(groups * d, -1))
        lead = x.shape[:-1]
        mixed = torch.cat(
            (q.view(*lead, groups, per * d), k.view(*lead, groups, d), v.view(*lead, groups, d)),
            dim=-1,
        )
        return mixed.view(*lead, groups * (per + 2) * d), None


class InvariantFC1(ColumnParallelLinear):
    """``linear_fc1`` (gate rows, then up rows) as the engine's two products."""

    def forward(self, x: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        w = self.weight if weight is None else weight
        half = w.shape[0] // 2
        return torch.cat((kernels.linear(x, w[:half]), kernels.linear(x, w[half:])), dim=-1), None


class InvariantRowLinear(RowParallelLinear):
    """``linear_proj`` and ``linear_fc2`` through :func:`kernels.linear` (one rank: no sum)."""

    def forward(self, x: Tensor, **_: Any) -> tuple[Tensor, None]:
        return kernels.linear(x, self.weight), None


class InvariantAttention(MegatronModule):
    """Core attention as the engine computes it (:func:`kernels.attention`): queries
    ``[sq, b, heads, d]``, keys and values ``[sk, b, groups, d]``, Megatron's mask (True: not
    attended); the output ``[sq, b, heads * d]``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, **_: Any) -> None:
        super().__init__(config=config)
        self.scale = config.kv_channels**-0.5

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **_: Any
    ) -> Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        out = kernels.attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True)
        sq, b, heads, d = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def block_spec(config: Any, qk_norm: bool, pp_rank: int) -> Any:
    """The decoder block of pipeline stage ``pp_rank`` with the modules above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = HFRMSNorm
    sub.pre_mlp_layernorm = HFRMSNorm
    attention = sub.self_attention.submodules
    attention.linear_qkv = InvariantQKV
    attention.core_attention = InvariantAttention
    attention.linear_proj = InvariantRowLinear
    if qk_norm:
        attention.q_layernorm = HFRMSNorm
        attention.k_layernorm = HFRMSNorm
    sub.mlp.submodules.linear_fc1 = InvariantFC1
    sub.mlp.submodules.linear_fc2 = InvariantRowLinear
    layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=HFRMSNorm)


def logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The vocabulary head as the engine's ``lm_head``: ``[s, b, h]`` to ``[b, s, vocab]``."""
    return kernels.linear(hidden, weight).transpose(0, 1)
