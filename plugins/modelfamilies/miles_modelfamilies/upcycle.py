"""Sparse upcycling: a dense Llama checkpoint (by default the shipped SmolLM2-135M-Instruct)
turned into a Mixtral mixture of experts, with no download.

Every layer's MLP is copied into ``experts`` experts (fused as transformers 5 stores them:
``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) and a router
``mlp.gate.weight [E, H]`` is added, drawn like a freshly initialised linear layer. Each copy
is then perturbed with seeded Gaussian noise, ``noise`` times the standard deviation of the
tensor it perturbs, so the experts differ and can specialise during training.

Mixtral, not Qwen3-MoE: Mixtral's attention is Llama's (Qwen3-MoE's adds q/k norms, which
would change the function), and its router always renormalises the top-k weights. With
identical experts (``noise=0``) each token's MLP output is then ``sum_k w_k * MLP(x)`` with
``sum_k w_k = 1``: the upcycled model computes the dense one, logits equal up to rounding.
Everything else (embeddings, attention, norms, head, tokenizer, chat template, generation
config) is copied as it is, so the dense model's family (``smollm2``) serves it unchanged.

Command line::

    python -m miles_modelfamilies.upcycle --experts 4 --top-k 2 --out DIR
        [--source DENSE_DIR] [--noise 0.01] [--router-std 0.02] [--seed 0]

writes a normal Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files)
that ``AutoModelForCausalLM.from_pretrained`` loads, and prints its path. Without ``--out``
it goes to ``~/.cache/miles/models/SmolLM2-135M-Instruct-MoE-E{experts}-top{k}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from miles_modelfamilies.smollm2_model import model_root, smollm2_model_folder

#: Files of the dense folder that are not copied: the weights and config are rewritten.
_REWRITTEN = {"config.json", "model.safetensors", "model.safetensors.index.json"}
#: Dense Llama config fields a Mixtral config carries over unchanged.
_CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_parameters",
    "attention_dropout",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def default_out(experts: int, top_k: int) -> Path:
    """Where the command writes without ``--out``."""
    return model_root() / f"SmolLM2-135M-Instruct-MoE-E{experts}-top{top_k}"


def mixtral_config(dense: dict[str, Any], *, experts: int, top_k: int) -> dict[str, Any]:
    """The Mixtral ``config.json`` of the upcycled model of a dense Llama ``config.json``.
    Raises ``ValueError`` naming the field for a dense model whose function Mixtral cannot
    reproduce."""
    if dense.get("model_type") != "llama":
        raise ValueError(
            f"model_type: {dense.get('model_type')!r} is not upcycled; allowed: 'llama'"
        )
    for field in ("attention_bias", "mlp_bias"):
        if dense.get(field):
            raise ValueError(f"{field}: Mixtral has no biases; allowed: false")
    if dense.get("pretraining_tp", 1) != 1:
        raise ValueError("pretraining_tp: allowed: 1")
    if dense.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {dense['hidden_act']!r}; allowed: 'silu'")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: {top_k} must be in 1..experts ({experts})")
    out = {k: dense[k] for k in _CARRIED if k in dense}
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
        dtype=dense.get("dtype", dense.get("torch_dtype", "float32")),
    )
    return out


def upcycle_state_dict(
    dense: dict[str, Any],
    *,
    num_layers: int,
    experts: int,
    noise: float,
    router_std: float,
    seed: int,
) -> dict[str, Any]:
    """The Mixtral state dict of a dense Llama state dict: each MLP copied ``experts`` times
    (each copy plus ``noise`` x the tensor's standard deviation of seeded Gaussian noise), a
    router of standard deviation ``router_std`` per layer, every other tensor as it is."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(num_layers):
        pre = f"model.layers.{i}.mlp."
        gate, up, down = (dense[f"{pre}{n}_proj.weight"] for n in ("gate", "up", "down"))
        gate_up = torch.cat([gate, up]).float()
        down = down.float()
        dtype = gate.dtype

        out[f"{pre}experts.gate_up_proj"] = _copies(gate_up, experts, noise, gen).to(dtype)
        out[f"{pre}experts.down_proj"] = _copies(down, experts, noise, gen).to(dtype)
        hidden = gate.shape[1]
        router = torch.randn((experts, hidden), generator=gen) * router_std
        out[f"{pre}gate.weight"] = router.to(dtype)
    return out


def _copies(w: Any, experts: int, noise: float, gen: Any) -> Any:
    """``experts`` copies of ``w`` stacked on a new first axis, each plus ``noise`` x
    ``w.std()`` of Gaussian noise drawn from ``gen``."""
    import torch

    stacked = w.unsqueeze(0).repeat(experts, *([1] * w.dim()))
    if noise > 0:
        stacked += torch.randn(stacked.shape, generator=gen) * (noise * float(w.std()))
    return stacked.contiguous()


def upcycle(
    source: Path | str,
    out: Path | str,
    *,
    experts: int = 4,
    top_k: int = 2,
    noise: float = 0.01,
    router_std: float | None = None,
    seed: int = 0,
) -> Path:
    """Write the Mixtral upcycling of the dense Llama folder ``source`` into ``out`` (see the
    module docstring) and return ``out``. ``router_std`` defaults to the dense config's
    ``initializer_range``."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    source, out = Path(source), Path(out)
    if experts < 1:
        raise ValueError(f"experts: {experts}; allowed: 1 or more")
    if noise < 0:
        raise ValueError(f"noise: {noise}; allowed: 0 or more")
    dense_config = json.loads((source / "config.json").read_text())
    config_dict = mixtral_config(dense_config, experts=experts, top_k=top_k)
    std = dense_config.get("initializer_range", 0.02) if router_std is None else router_std
    weights = source / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{source}: no model.safetensors (a sharded checkpoint is not read)")
    state = upcycle_state_dict(
        load_file(str(weights)),
        num_layers=int(dense_config["num_hidden_layers"]),
        experts=experts,
        noise=noise,
        router_std=std,
        seed=seed,
    )
    config = MixtralConfig(**{k: v for k, v in config_dict.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=state["model.norm.weight"].dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [m for m in missing if not (config.tie_word_embeddings and "lm_head" in m)]:
        raise ValueError(f"upcycled weights do not fit Mixtral: {missing=} {unexpected=}")
    if config.tie_word_embeddings:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in source.iterdir():
        if f.is_file() and f.name not in _REWRITTEN:
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m miles_modelfamilies.upcycle``: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m miles_modelfamilies.upcycle",
        description="Upcycle a dense Llama (default: SmolLM2-135M-Instruct) into a Mixtral MoE.",
    )
    parser.add_argument("--experts", type=int, default=4, help="experts per layer (default 4)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--out", type=Path, help="output folder (default: under the cache)")
    parser.add_argument("--source", type=Path, help="dense folder (default: SmolLM2, converted)")
    parser.add_argument(
        "--noise", type=float, default=0.01, help="perturbation, x the weight's std (0.01)"
    )
    parser.add_argument(
        "--router-std", type=float, help="router init std (default: initializer_range)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise and router")
    args = parser.parse_args(argv)
    source = args.source or smollm2_model_folder()
    out = args.out or default_out(args.experts, args.top_k)
    upcycle(
        source,
        out,
        experts=args.experts,
        top_k=args.top_k,
        noise=args.noise,
        router_std=args.router_std,
        seed=args.seed,
    )
    print(out)


if __name__ == "__main__":
    main()
