"""True on-policy mode's kernels (miles_core.invariant.kernels) on a CUDA device: whether the
batch invariance that the CPU tests show also holds with cuBLAS and the GPU's kernels.

Checks, each True or False in the last line (JSON), with the largest difference seen:

* ``linear_rows``: a row of the invariant linear is bitwise the same in batches of 1 to 83
  rows, in float32 and bfloat16.
* ``attention_decode``: one query against a padded KV cache equals that query's row of a causal
  prefill, bitwise.
* ``model_decode``: a tiny random Llama decoded token by token through a KV cache gives the
  log-probs of a right-padded teacher-forced batch of four sequences, bitwise (float32).
* ``rmsnorm_rows``, ``log_softmax_rows``: a row of each reduction is bitwise the same in
  batches of 1 to 83 rows (not made invariant by the mode: where ``model_decode`` fails, these
  say whether they are why).
* ``plain_differs``: the same model without the mode differs (the check can fail).

    python3 scripts/device/true_on_policy_cuda_check.py
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from miles_core.invariant.kernels import TILE, attention, invariant_mode, linear


def linear_rows(dev: str, dtype: torch.dtype) -> tuple[bool, float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(1536, 576, generator=g).to(dev, dtype)
    row = torch.randn(1, 576, generator=g).to(dev, dtype)
    ref = linear(row, w)[0]
    worst = 0.0
    for n in (1, 2, 15, 16, 17, 40, 83):
        batch = torch.cat([torch.randn(n - 1, 576, generator=g).to(dev, dtype), row])
        worst = max(worst, float((linear(batch, w)[-1] - ref).abs().max()))
    return worst == 0.0, worst


def reduction_rows(dev: str, op: str) -> tuple[bool, float]:
    """A row of a per-row reduction (``rmsnorm``: Llama's RMSNorm over the hidden size, as the
    model computes it; ``log_softmax``: over the vocabulary) is bitwise the same in batches
    of 1 to 83 rows: the kernels' choice of reduction may depend on the number of rows."""
    g = torch.Generator(device="cpu").manual_seed(3)
    width = 576 if op == "rmsnorm" else 49152

    def f(x: torch.Tensor) -> torch.Tensor:
        if op == "log_softmax":
            return torch.log_softmax(x, -1)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    row = torch.randn(1, width, generator=g).to(dev)
    ref = f(row)[0]
    worst = 0.0
    for n in (2, 15, 16, 17, 40, 83):
        batch = torch.cat([torch.randn(n - 1, width, generator=g).to(dev), row])
        worst = max(worst, float((f(batch)[-1] - ref).abs().max()))
    return worst == 0.0, worst


def attention_decode(dev: str) -> tuple[bool, float]:
    g = torch.Generator(device="cpu").manual_seed(1)
    b, h, hkv, n, d = 2, 9, 3, TILE + 50, 64
    q, k, v = (torch.randn(b, x, n, d, generator=g).to(dev) for x in (h, hkv, hkv))
    full = attention(q, k, v, is_causal=True, enable_gqa=True)
    worst = 0.0
    for p in (0, 7, TILE, n - 1):
        pad = n + TILE
        kc = torch.zeros(b, hkv, pad, d, device=dev)
        vc = torch.zeros(b, hkv, pad, d, device=dev)
        kc[:, :, : p + 1], vc[:, :, : p + 1] = k[:, :, : p + 1], v[:, :, : p + 1]
        mask = (torch.arange(pad, device=dev) <= p).view(1, 1, 1, pad)
        one = attention(q[:, :, p : p + 1], kc, vc, attn_mask=mask, enable_gqa=True)
        worst = max(worst, float((one[:, :, 0] - full[:, :, p]).abs().max()))
    return worst == 0.0, worst


def tiny_llama(dev: str) -> tuple[Any, list[torch.Tensor], torch.Tensor, torch.Tensor, Any]:
    """A tiny random Llama on ``dev``, four sequences of several lengths, their right-padded
    batch and mask, and a decode step function ``step(tokens, cache) -> logits``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev).eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    seqs = [torch.randint(0, 512, (n,), generator=g).to(dev) for n in (5, 40, TILE + 30, 11)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
    mask = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    # the cache's keyword: ``cache`` in recent transformers, ``past_key_values`` before
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step(tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=tokens[None], **{kw: cache}).logits[0]

    return model, seqs, ids, mask, step


def decode(model: Any, seq: torch.Tensor, step: Any) -> torch.Tensor:
    """``seq`` through a fresh KV cache: a prefill of 3 tokens, then one token at a time; the
    logits of every position."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    steps = [step(seq[:3], cache)]
    for t in range(3, len(seq)):
        steps.append(step(seq[t : t + 1], cache))
    return torch.cat(steps)


def model_decode(dev: str, on: bool) -> tuple[bool, float]:
    model, seqs, ids, mask, step = tiny_llama(dev)
    worst = 0.0
    with torch.no_grad(), invariant_mode(on):
        batch = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
        for i, s in enumerate(seqs):
            decoded = torch.log_softmax(decode(model, s, step), -1)
            worst = max(worst, float((decoded - batch[i, : len(s)]).abs().max()))
    return worst == 0.0, worst


def first_divergence(dev: str) -> list[str]:
    """Where ``model_decode`` differs, in the mode: the modules (in the order the batch's
    forward finished them) whose output for one sequence differs between the token-by-token
    decode and the padded batch, each with its largest difference (the first five)."""
    model, seqs, ids, mask, step = tiny_llama(dev)
    seen: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []

    def hook(name: str) -> Any:
        def record(_m: Any, _a: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                seen.setdefault(name, []).append(t.detach().clone())
                if name not in order:
                    order.append(name)

        return record

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(hook(name))
    found: list[str] = []
    with torch.no_grad(), invariant_mode():
        model(input_ids=ids, attention_mask=mask)
        batch = {n: v[0] for n, v in seen.items()}
        for i, x in enumerate(seqs):
            seen.clear()
            decode(model, x, step)
            for name in order:
                parts = seen.get(name, [])
                if not parts or batch[name].shape[0] != len(seqs) or parts[0].shape[0] != 1:
                    continue
                try:
                    dec = torch.cat(parts, 1)[0]
                    ref = batch[name][i, : dec.shape[0]]
                    diff = float((dec - ref).abs().max())
                except RuntimeError:
                    continue
                if diff and not any(f.startswith(name + ":") for f in found):
                    found.append(f"{name}: {diff:.3g} (seq {i})")
    keyed = sorted(found, key=lambda f: order.index(f.split(":")[0]))
    return keyed[:5]


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, object] = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev}
    for name, (ok, worst) in {
        "linear_rows_fp32": linear_rows(dev, torch.float32),
        "linear_rows_bf16": linear_rows(dev, torch.bfloat16),
        "attention_decode": attention_decode(dev),
        "rmsnorm_rows": reduction_rows(dev, "rmsnorm"),
        "log_softmax_rows": reduction_rows(dev, "log_softmax"),
        "model_decode": model_decode(dev, True),
    }.items():
        out[name], out[f"{name}_max_diff"] = ok, worst
    same, worst = model_decode(dev, False)
    out["plain_differs"], out["plain_max_diff"] = not same, worst
    if not out["model_decode"]:
        out["first_divergence"] = first_divergence(dev)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
