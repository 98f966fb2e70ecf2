"""A lean forward for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) and their
mixture-of-experts siblings (Qwen3-MoE, Mixtral).

It runs the same tensor operations, in the same order, as the transformers modules of these
families, over the same parameters, but without the per-module Python machinery (hooks,
decorators, keyword plumbing), which dominates a decode step of a small model on a CPU. Any
other architecture, or a configuration this path does not model (sliding windows, scaled
embeddings...), uses the model's own forward. Both paths are checked against a
teacher-forced forward of the transformers model in the tests.

The departures (``attention: native``, the default where it applies; :mod:`.native`): the
decode rows' attention runs in a native kernel, each row over its own length, in one call per
layer; in the dense layers without adapters, so do the residual adds with the RMS norms after
them, ``silu(gate) * up``, and in a decode or packed forward the rotation of the queries and
keys with the store of the keys and values. The kernels round otherwise than the torch
operations they replace (within float32 rounding of the same arithmetic).

An MoE layer (an ``mlp`` with a router ``gate`` and fused ``experts``) calls those two modules
of the model itself: the router (softmax -> top-k -> renormalised as the family does) and the
experts implementation transformers selected (``grouped_mm`` by default) are then exactly the
model's, and the top-k expert ids each token was routed to are at hand for the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_engine_embedded import native
from miles_engine_embedded.kv_cache import PackedRows, additive
from miles_engine_embedded.lora import LoraBatch
from miles_engine_embedded.matmul import MatmulPlan, plan_for

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"}


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as transformers computes it, given ``sin`` with its
    first half negated: ``rotate_half(x) = cat(-x2, x1)``, so ``rotate_half(x) * sin`` is
    ``roll(x) * cat(-sin1, sin2)`` term by term, negation being exact (one operation less,
    and a roll in place of a negation and a concatenation)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    groups: int,
) -> torch.Tensor:
    """One query per sequence ``q [b, heads, 1, d]`` over ``k``/``v [b, kv_heads, L, d]``."""
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Fold the query heads sharing a key/value head into the query-length axis, so no
    # key/value is repeated.
    b, heads, _, hd = q.shape
    qg = q.reshape(b, heads // groups, groups, hd)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, heads, 1, hd)


def _packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: PackedRows,
    scale: float,
    groups: int,
    native_kernel: bool,
) -> torch.Tensor:
    """The attention of a packed forward's rows ``q [1, heads, T, d]``, each part over its own
    keys in the cache (whose rows ``update`` has just stored): the decode rows as one batch
    (by the native kernel, each over its own length, when ``native_kernel``), then each
    segment over its slot's positions up to its own, causally. Returns ``[1, T, heads * d]``."""
    _, heads, t, hd = q.shape
    b = rows.batch
    out = None
    parts = []
    if b and native_kernel:
        out = q.new_empty(1, t, heads * hd)
        qd = q[:, :, :b].permute(2, 1, 0, 3)  # [b, heads, 1, d]
        native.decode_attention(qd, k_cache, v_cache, rows.lengths, out[0, :b], scale)
    elif b:
        qd = q[:, :, :b].permute(2, 1, 0, 3)
        k, v = k_cache[:b, :, : rows.visible], v_cache[:b, :, : rows.visible]
        parts.append(_decode_attention(qd, k, v, rows.mask, scale, groups).permute(2, 1, 0, 3))
    row = b
    for (slot, start, length), mask in zip(rows.segments, rows.segment_masks, strict=True):
        end = start + length
        o = F.scaled_dot_product_attention(
            q[:, :, row : row + length],
            k_cache[slot : slot + 1, :, :end],
            v_cache[slot : slot + 1, :, :end],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=groups > 1,
        )
        if out is not None:
            out[0, row : row + length].view(length, heads, hd).copy_(o[0].transpose(0, 1))
        else:
            parts.append(o)
        row += length
    if out is not None:
        return out
    o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return o.transpose(1, 2).reshape(1, t, -1)


def is_moe(mlp: Any) -> bool:
    """Whether a decoder layer's ``mlp`` is a mixture of experts as transformers 5 builds one:
    a router ``gate`` (``weight [E, H]``) and ``experts`` with fused 3-D weights."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.gate, "top_k")


#: the rotary tables of one forward, in the layouts the layers read (see
#: :meth:`LeanForward._rotations`)
Rotations = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


class LeanForward:
    """Callable ``(ids, position_ids, mask, cache, keep) -> logits`` over a loaded model.

    With a packed cache (:class:`~.kv_cache.PackedRows`), ``ids [1, T]`` are the rows of
    several sequences and ``mask`` is unused: the cache says whose keys each row reads.

    The q/k/v and gate/up projections run as one matrix product each over concatenated
    weights: those copies must be rebuilt (a new ``LeanForward``) after any weight update.
    Each dense product runs in the layout ``matmul`` chooses (:mod:`.matmul`: ``auto``
    measures once per process which is faster here).
    """

    def __init__(self, model: Any, matmul: str = "auto", attention: str = "auto") -> None:
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
            if is_moe(m):
                mlp: tuple[Any, ...] = (None, 0, None, None, (m.gate, m.experts))
            else:
                gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
                mlp = (gu, m.gate_proj.weight.shape[0], m.down_proj.weight, m.act_fn, None)
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
                    *mlp,
                    a.head_dim,
                    a.num_key_value_groups,
                    a.scaling,
                )
            )
        self.num_layers = cfg.num_hidden_layers
        dense = [w for layer in self.layers for w in (layer[1][0], layer[3][0], layer[7], layer[9])]
        #: the layout of each product (the MoE layers' experts are the model's own)
        self.plan: MatmulPlan = plan_for(
            [w for w in dense if w is not None] + [self.lm_head.detach()], matmul
        )
        a = base.layers[0].self_attn
        heads, hd = cfg.num_attention_heads, a.head_dim
        why_not = native.applies(
            self.embed.dtype, self.embed.device, heads, heads // a.num_key_value_groups, hd
        )
        #: whether decode rows attend through the native kernel (:mod:`.native`)
        self.native = native.resolve(attention, why_not)
        #: the indices of the layers whose MLP is a mixture of experts
        self.moe_layers = [i for i, layer in enumerate(self.layers) if layer[11] is not None]
        #: the native kernels also run the residual adds, the RMS norms and ``silu(gate) * up``
        #: of the dense layers (one call each in place of five to seven torch operations)
        self.fused = (
            self.native
            and not self.moe_layers
            and getattr(cfg, "hidden_act", None) in ("silu", "swish")
        )

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
        if getattr(cfg, "sliding_window", None) and cfg.model_type == "mixtral":
            return False  # the mask of a sliding window is not modelled here
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
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # ``lora``: the adapters' per-row deltas (see :mod:`.lora`); None, the base model alone,
        # costs one test per projection group. ``routing``: when a list, the top-k expert ids
        # ``[B, N, k]`` of every MoE layer are appended to it, in layer order.
        h = F.embedding(ids, self.embed)
        if mask is not None and mask.dtype == torch.bool:
            mask = additive(mask, h.dtype)  # once, not in every layer's attention
        rot = self._rotations(h, position_ids)
        # the fused path (dense layers, no adapter): the residual stream ``h`` is updated in
        # place, each layer's last product added by the next norm (``pending``)
        fused = self.fused and lora is None
        # and in a decode or packed forward, the rotation and the cache store in one call
        store = getattr(cache, "rows", None) if fused else None
        if fused:
            h = h.contiguous()
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            ln1 = layer[0]
            x = native.add_rms_norm(h, pending, *ln1) if fused else _rms(h, *ln1)
            q, k, v = self._qkv(i, layer, x, rot, cache, store, lora)
            o = self._attend(q, k, v, layer, cache, mask)
            h, pending = self._mlp(i, layer, h, o, fused, lora, routing)
        return self._logits(h, pending, fused, keep, store, cache)

    def _rotations(self, h: torch.Tensor, position_ids: torch.Tensor) -> Rotations:
        """The rotary tables of ``position_ids`` in each layout the layers read: ``[b, n, d]``
        (the native rotation), ``[b, n, 1, d]`` against tokens-first q/k, ``[b, 1, n, d]``
        against heads-first; the sine's first half negated (for ``_rotate``)."""
        cos, sin = self.rotary(h, position_ids=position_ids)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # for ``_rotate``
        return (
            cos,
            sin,
            cos.unsqueeze(2),
            sin.unsqueeze(2),
            cos.unsqueeze(1),
            sin.unsqueeze(1),
        )

    def _qkv(
        self,
        i: int,
        layer: Any,
        x: torch.Tensor,
        rot: Rotations,
        cache: Any,
        store: Any,
        lora: LoraBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s rotated queries, and the keys and values it attends to (its new ones
        stored in ``cache``), each heads-first."""
        # ``mm``: a contiguous result (split into heads, or the logits); ``mms``: any layout
        # (it only feeds element-wise work and further products)
        mm, mms = self.plan.linear, self.plan.strided
        qkv, sizes, qn, kn, hd = layer[1], layer[2], layer[4], layer[5], layer[12]
        cos_r, sin_r, cos_t, sin_t, cos, sin = rot
        b, n = x.shape[0], x.shape[1]
        if store is not None and qn is None and kn is None:
            y = mms(x, *qkv)  # read where the product left it: no copy
            q = native.rope_store(
                y, cos_r, sin_r, cache.keys[i], cache.values[i], store, sizes[0] // hd, hd
            )
            k, v = cache.attended(i)
            return q.view(b, n, -1, hd).transpose(1, 2), k, v
        if lora is None and qn is None and kn is None:
            y = mm(x, *qkv)
            # q and k lie side by side in y: one rotation over both heads' sets (the same
            # arithmetic for every element, half the operations)
            qk = y[..., : sizes[0] + sizes[1]].view(b, n, -1, hd)
            qk = _rotate(qk, cos_t, sin_t)
            q = qk[:, :, : sizes[0] // hd].transpose(1, 2)
            k = qk[:, :, sizes[0] // hd :].transpose(1, 2)
            v = y[..., sizes[0] + sizes[1] :].view(b, n, -1, hd).transpose(1, 2)
            k, v = cache.update(k, v, i)
            return q, k, v
        y = mm(x, *qkv)
        q, k, v = y.split(sizes, dim=-1)
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
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = cache.update(k, v, i)
        return q, k, v

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        cache: Any,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention output ``[b, n, heads * head_dim]`` of one layer."""
        hd, groups, scale = layer[12], layer[13], layer[14]
        b, n = q.shape[0], q.shape[2]
        packed = getattr(cache, "packed", None)
        if packed is not None:
            return _packed_attention(q, k, v, packed, scale, groups, self.native)
        if n == 1 and self.native and getattr(cache, "lengths", None) is not None:
            o = q.new_empty(b, 1, q.shape[1] * hd)
            native.decode_attention(q, k, v, cache.lengths, o.view(b, -1), scale)
            return o
        if n == 1:
            o = _decode_attention(q, k, v, mask, scale, groups)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1
            )
        return o.transpose(1, 2).reshape(b, n, -1)

    def _mlp(
        self,
        i: int,
        layer: Any,
        h: torch.Tensor,
        o: torch.Tensor,
        fused: bool,
        lora: LoraBatch | None,
        routing: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s output projection and MLP (or experts) over the attention output
        ``o``: the new residual stream, and on the fused path the product the next norm adds
        (``pending``; the stream is then updated in place)."""
        mms = self.plan.strided
        op, ln2, gu, inter, dw, act, moe = layer[3], *layer[6:12]
        if moe is not None:  # adapters apply to the attention only (no MLP linear)
            b, n = h.shape[0], h.shape[1]
            o = mms(o, *op) if lora is None else lora.add(i, "o_proj", o, mms(o, *op))
            h = h + o
            x = _rms(h, *ln2).reshape(b * n, -1)
            gate, experts = moe
            _, weights, chosen = gate(x)
            if routing is not None:
                routing.append(chosen.view(b, n, -1))
            return h + experts(x, chosen, weights).view(b, n, -1), None
        if fused:
            x = native.add_rms_norm(h, mms(o, *op), *ln2)
            return h, mms(native.silu_mul(mms(x, gu), inter), dw)
        if lora is None:
            h = h + mms(o, *op)
            x = _rms(h, *ln2)
            gate, up = mms(x, gu).split(inter, dim=-1)
            return h + mms(act(gate) * up, dw), None
        h = h + lora.add(i, "o_proj", o, mms(o, *op))
        x = _rms(h, *ln2)
        gate, up = mms(x, gu).split(inter, dim=-1)
        gate = lora.add(i, "gate_proj", x, gate)
        up = lora.add(i, "up_proj", x, up)
        g = act(gate) * up
        return h + lora.add(i, "down_proj", g, mms(g, dw)), None

    def _logits(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        fused: bool,
        keep: torch.Tensor | None,
        store: Any,
        cache: Any,
    ) -> torch.Tensor:
        """The final norm and the logits of the kept positions (all when ``keep`` is None)."""
        mm, mms = self.plan.linear, self.plan.strided
        n = h.shape[1]
        if fused:
            h = native.add_rms_norm(h, pending, *self.norm)
            if keep is None and n == 1 and store is not None and cache.packed is None:
                # a decode step's logits, in the product's own layout: the engine's sampler
                # reads them there (the native one in either layout; a copy costs 1 ms a step
                # at batch 16 on SmolLM2-135M)
                return mms(h, self.lm_head)
            return mm(h if keep is None else h[:, keep], self.lm_head)
        if keep is not None:
            h = h[:, keep]
        h = _rms(h, *self.norm)
        return mm(h, self.lm_head)
