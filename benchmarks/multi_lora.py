"""Multi-adapter serving: one batch mixing 4 LoRA adapters against the same batch on one adapter.

Same embedded engine (a live server with ``enable_lora``), same run, same prompts and lengths:

* **single**: every request of the batch names adapter ``a0``;
* **mixed**: the requests name ``a0..a3`` in turn (4 adapters in every step of the batch);
* **base**: no request names an adapter (the base forward: no LoRA work at all).

Adapters: r=8, ``lora_alpha`` 16, on every attention and MLP projection (q, k, v, o, gate, up,
down), random A and B, loaded through ``/load_lora_adapter_from_tensors`` with PEFT names.
Requests: ``--batch`` prompts of ``--prompt-len`` random tokens, ``--max-new`` tokens each
(end of sequence ignored, so every side does the same work), all submitted at once, the sides
interleaved ``--rounds`` times and the best round of each kept.

Prints the settings first, a line per round and side, and last one JSON line with
``mixed_over_single`` (goal >= 0.8: serving several adapters at once costs little more than one),
``single_over_base`` and every figure behind them.

    .venv/bin/python benchmarks/multi_lora.py [--model smollm2|tiny] [--threads 2] [--batch 16]
        [--prompt-len 64] [--max-new 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import describe

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_folder(name: str, root: Path) -> Path:
    if name == "smollm2":
        from miles_modelfamilies.smollm2_model import smollm2_model_folder

        return smollm2_model_folder()
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    path = root / "tiny"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def make_adapter(path: Path, r: int, seed: int) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A PEFT-format adapter (config dict, named tensors) for every projection of the model."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    q = cfg.num_attention_heads * head_dim
    shapes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(cfg.num_hidden_layers):
        for mod, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if mod in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            named.append((f"{prefix}.lora_A.weight", torch.randn(r, fan_in, generator=g) * 0.01))
            named.append((f"{prefix}.lora_B.weight", torch.randn(fan_out, r, generator=g) * 0.01))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS)}
    return config, named


async def timed(url: str, prompts: list[list[int]], loras: list[str | None], max_new: int) -> float:
    from miles_engine_client import EngineClient

    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0},
        "lora_path": loras,
    }
    async with EngineClient(url) as c:
        start = time.perf_counter()
        out = await c.request("POST", "/generate", body)
        seconds = time.perf_counter() - start
    assert sum(len(o["output_ids"]) for o in out) == len(prompts) * max_new
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    describe(vars(args))
    from miles_engine_client import EngineClient
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = model_folder(args.model, Path(tmp))
        vocab = 512 if args.model == "tiny" else 49152
        g = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.batch)
        ]
        launcher = build(
            EmbeddedEngineConfig(
                max_running_requests=args.batch,
                context_length=args.prompt_len + args.max_new + 8,
                num_threads=args.threads,
                enable_lora=True,
                max_lora_rank=max(8, args.rank),
                startup_timeout_s=600,
            )
        )
        url = launcher.launch(str(path), index=0)
        try:

            async def load() -> None:
                async with EngineClient(url) as c:
                    for i in range(4):
                        config, named = make_adapter(path, args.rank, seed=i)
                        await c.load_lora_adapter_from_tensors(f"a{i}", named, config)

            asyncio.run(load())
            sides: dict[str, list[str | None]] = {
                "single": ["a0"] * args.batch,
                "mixed": [f"a{i % 4}" for i in range(args.batch)],
                "base": [None] * args.batch,
            }
            asyncio.run(timed(url, prompts[:2], ["a0", "a1"], 4))  # warm-up
            best: dict[str, float] = {}
            for rnd in range(args.rounds):
                for name, loras in sides.items():
                    s = asyncio.run(timed(url, prompts, loras, args.max_new))
                    tok_s = args.batch * args.max_new / s
                    print(f"round {rnd} {name}: {tok_s:.1f} tok/s ({s:.2f} s)", flush=True)
                    best[name] = max(best.get(name, 0.0), tok_s)
        finally:
            launcher.shutdown()
    out: dict[str, Any] = {
        "model": args.model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_new": args.max_new,
        "rank": args.rank,
        "adapters_mixed": 4,
        "threads": args.threads,
        "cpus": os.cpu_count(),
    }
    for name, v in best.items():
        out[f"{name}_tok_s"] = round(v, 2)
    out["mixed_over_single"] = round(best["mixed"] / best["single"], 3)
    out["single_over_base"] = round(best["single"] / best["base"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
