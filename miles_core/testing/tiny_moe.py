"""Tiny random mixture-of-experts causal LMs for tests, shared by the core's and the plugins'.

Two Hugging Face architectures, as transformers 5 builds them: the experts of a layer are
fused into two 3-D parameters, ``mlp.experts.gate_up_proj`` ``[E, 2 * I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]``, and the router is ``mlp.gate.weight`` ``[E, H]``.

* ``qwen3_moe`` (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norms); softmax -> top-k ->
  renormalised when ``norm_topk_prob``; some layers may stay dense (``mlp_only_layers``).
* ``mixtral`` (``MixtralForCausalLM``): Llama attention; softmax -> top-k -> always
  renormalised.

Nothing is downloaded: the weights are drawn from a seed. This module imports transformers
only inside its functions, and only tests call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The architectures :func:`tiny_moe_config` builds (``config.model_type``).
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


def tiny_moe_config(
    arch: str = "qwen3_moe",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    expert_size: int = 32,
    num_layers: int = 2,
    num_experts: int = 4,
    top_k: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    dense_layers: Sequence[int] = (),
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
) -> Any:
    """The config of a tiny MoE of architecture ``arch`` (one of :data:`MOE_ARCHITECTURES`):
    ``num_experts`` experts of width ``expert_size`` per layer, ``top_k`` of them per token.
    ``dense_layers`` (``qwen3_moe`` only): layers that keep a dense MLP instead, so a model
    mixes both kinds, as Qwen3-MoE checkpoints may. Token ids 0/1/2 are pad/bos/eos."""
    if arch not in MOE_ARCHITECTURES:
        raise ValueError(f"arch: {arch!r} is not built; allowed: {', '.join(MOE_ARCHITECTURES)}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts_per_tok=top_k,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    if arch == "qwen3_moe":
        import transformers

        qwen3_moe: Any = transformers.Qwen3MoeConfig  # untyped keyword arguments
        return qwen3_moe(
            head_dim=hidden_size // heads,
            intermediate_size=2 * expert_size,  # the dense layers' MLP
            moe_intermediate_size=expert_size,
            num_experts=num_experts,
            norm_topk_prob=True,
            mlp_only_layers=list(dense_layers),
            **common,
        )
    if dense_layers:
        raise ValueError("dense_layers: only qwen3_moe mixes dense and MoE layers; allowed: ()")
    import transformers

    mixtral: Any = transformers.MixtralConfig
    return mixtral(
        intermediate_size=expert_size,
        num_local_experts=num_experts,
        sliding_window=None,
        **common,
    )


def save_tiny_moe(
    path: Path | str, arch: str = "qwen3_moe", *, seed: int = 0, scale: float = 1.0, **config: Any
) -> Path:
    """Save a random tiny MoE (:func:`tiny_moe_config` with ``config``) at ``path`` and return
    it. ``scale`` multiplies every matrix (router and fused experts included): random init is
    nearly uniform, and larger weights make the token distributions and the router's choices
    peaked, as in a trained model."""
    import torch
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(tiny_moe_config(arch, **config))
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    model.save_pretrained(path)
    return Path(path)
