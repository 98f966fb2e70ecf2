"""A lean forward for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3).

It runs the same tensor operations, in the same order, as the transformers modules of these
families, over the same parameters, but without the per-module Python machinery (hooks,
decorators, keyword plumbing), which dominates a decode step of a small model on a CPU. Any
other architecture, or a configuration this path does not model (sliding windows, scaled
embeddings...), uses the model's own forward. Both paths are checked against a
teacher-forced forward of the transformers model in the tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_engine_embedded.lora import LoraBatch

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the casts of the reference are no-ops: skip their calls
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def _cat_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("mixed biases")
    return torch.cat(biases)  # type: ignore[arg-type]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanForward:
    """Callable ``(ids, position_ids, mask, cache, keep) -> logits`` over a loaded model.

    The q/k/v and gate/up projections run as one matrix product each over concatenated
    weights: those copies must be rebuilt (a new ``LeanForward``) after any weight update.
    """

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        base = model.model
        self.embed = base.embed_tokens.weight
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = model.lm_head.weight
        self.rotary = base.rotary_emb
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
            qkv_b = _cat_bias(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
            sizes = (a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0])
            self.layers.append(
                (
                    (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                    (qkv_w, None if qkv_b is None else qkv_b.detach()),
                    sizes,
                    (a.o_proj.weight, a.o_proj.bias),
                    (a.q_norm.weight, a.q_norm.variance_epsilon) if hasattr(a, "q_norm") else None,
                    (a.k_norm.weight, a.k_norm.variance_epsilon) if hasattr(a, "k_norm") else None,
                    (
                        layer.post_attention_layernorm.weight,
                        layer.post_attention_layernorm.variance_epsilon,
                    ),
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                    m.gate_proj.weight.shape[0],
                    m.down_proj.weight,
                    m.act_fn,
                    a.head_dim,
                    a.num_key_value_groups,
                    a.scaling,
                )
            )
        self.num_layers = cfg.num_hidden_layers

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether ``model`` is one of the families this path reproduces exactly."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            return False
        if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_bias", False):
            return False
        if getattr(cfg, "pretraining_tp", 1) != 1:
            return False
        base = getattr(model, "model", None)
        return all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) and (
            len(base.layers) == cfg.num_hidden_layers
        )

    def __call__(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        keep: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        # ``lora``: the adapters' per-row deltas (see :mod:`.lora`); None, the base model alone,
        # costs one test per projection group.
        h = F.embedding(ids, self.embed)
        b, n, _ = h.shape
        cos, sin = self.rotary(h, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            ln1, qkv, sizes, op, qn, kn, ln2, gu, inter, dw, act, hd, groups, scale = layer
            x = _rms(h, *ln1)
            q, k, v = F.linear(x, *qkv).split(sizes, dim=-1)
            if lora is not None:
                q = lora.add(i, "q_proj", x, q)
                k = lora.add(i, "k_proj", x, k)
                v = lora.add(i, "v_proj", x, v)
            q = q.view(b, n, -1, hd)
            k = k.view(b, n, -1, hd)
            v = v.view(b, n, -1, hd).transpose(1, 2)
            if qn is not None:
                q = _rms(q, *qn)
            if kn is not None:
                k = _rms(k, *kn)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = cache.update(k, v, i)
            if n == 1 and groups > 1:
                # One query per sequence: fold the query heads sharing a key/value head into
                # the query-length axis, so no key/value is repeated.
                heads = q.shape[1]
                qg = q.reshape(b, heads // groups, groups, hd)
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
                o = o.reshape(b, heads, 1, hd)
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1
                )
            o = o.transpose(1, 2).reshape(b, n, -1)
            if lora is None:
                h = h + F.linear(o, *op)
                x = _rms(h, *ln2)
                gate, up = F.linear(x, gu).split(inter, dim=-1)
                h = h + F.linear(act(gate) * up, dw)
            else:
                h = h + lora.add(i, "o_proj", o, F.linear(o, *op))
                x = _rms(h, *ln2)
                gate, up = F.linear(x, gu).split(inter, dim=-1)
                gate = lora.add(i, "gate_proj", x, gate)
                up = lora.add(i, "up_proj", x, up)
                g = act(gate) * up
                h = h + lora.add(i, "down_proj", g, F.linear(g, dw))
        if keep is not None:
            h = h[:, keep]
        h = _rms(h, *self.norm)
        return F.linear(h, self.lm_head)
