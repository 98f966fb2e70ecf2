"""Embedded engine vs Hugging Face ``generate`` on a long-tail workload, same model, same run.

Workload: N requests whose new-token lengths follow a heavy-tailed (Pareto) distribution
clipped to [16, 256], at most 16 running at once. The engine gets every request at once
(continuous batching on 16 slots); ``generate`` runs static batches of 16 in the same order,
each batch until its longest request. Only useful tokens count: each request's own new tokens,
end-of-sequence ignored. Prints tokens/s of both and, last, one JSON line with
``ratio_tiny`` and ``ratio_smollm2`` (engine / generate).

    .venv/bin/python benchmarks/engine.py [--quick] [--threads 2] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CACHE = Path(os.path.expanduser("~/.cache/miles"))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF)."""
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    return smollm2_model_folder()


def tiny_folder(root: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    path = root / "tiny"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def workload(n: int, max_new: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt, new-token length) pairs; lengths Pareto(alpha=1.2) * 16, clipped."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(max_new, max(16, 16 * rng.paretovariate(1.2))))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
        out.append((prompt, length))
    return out


def run_generate(path: Path, work: list[tuple[list[int], int]], batch: int) -> tuple[int, float]:
    """Static batches with HF ``generate``; returns (useful tokens, seconds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # warm-up, as the engine gets one
        model.generate(
            input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=True, pad_token_id=0
        )
    useful = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(n for _, n in chunk)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0,
            )  # fmt: skip
        assert out.shape[1] == width + longest
        useful += sum(n for _, n in chunk)
    return useful, time.perf_counter() - t0


def run_engine(
    path: Path, work: list[tuple[list[int], int]], batch: int, threads: int, dtype: str
) -> tuple[int, float]:
    """All requests at once against a live embedded server; returns (useful tokens, seconds)."""
    sys.path[:0] = [
        str(Path(__file__).resolve().parents[1] / "plugins/backends/engines/embedded"),
        str(Path(__file__).resolve().parents[1] / "plugins/backends/engines/client"),
    ]
    from miles_engine_client import EngineClient
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=batch, num_threads=threads, dtype=dtype, context_length=512
        )
    )
    url = launcher.launch(str(path), index=0)

    async def go() -> tuple[int, float]:
        async with EngineClient(url, timeout_s=3600) as c:
            await c.generate([3, 4, 5], {"max_new_tokens": 4})  # warm-up
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *[
                    c.generate(p, {"max_new_tokens": n, "ignore_eos": True}, return_logprob=True)
                    for p, n in work
                ]
            )
            dt = time.perf_counter() - t0
            for (_, n), r in zip(work, results, strict=True):
                assert len(r.output_ids) == n, (len(r.output_ids), n)
            return sum(len(r.output_ids) for r in results), dt

    try:
        return asyncio.run(go())
    finally:
        launcher.shutdown()


def compare(name: str, path: Path, work: list[tuple[list[int], int]], args: Any) -> float:
    """Run both on one model; print and return engine tokens/s over generate tokens/s."""
    tok_e, t_e = run_engine(path, work, args.batch, args.threads, "float32")
    tok_g, t_g = run_generate(path, work, args.batch)
    e, g = tok_e / t_e, tok_g / t_g
    print(
        f"{name}: {len(work)} requests, {tok_e} useful tokens | engine {e:.1f} tok/s "
        f"({t_e:.1f} s) | generate {g:.1f} tok/s ({t_g:.1f} s) | ratio {e / g:.2f}",
        flush=True,
    )
    return e / g


def main() -> None:
    """Run the benchmark and print the ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests and shorter tails")
    p.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    p.add_argument("--batch", type=int, default=16, help="max running / static batch size")
    p.add_argument("--skip-smollm2", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n_tiny, n_smol, max_new = (32, 16, 128) if args.quick else (64, 64, 256)
    out: dict[str, float | None] = {"ratio_tiny": None, "ratio_smollm2": None}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_folder(Path(tmp))
        out["ratio_tiny"] = round(compare("tiny", tiny, workload(n_tiny, max_new, 512), args), 3)
    if not args.skip_smollm2:
        smol = smollm2_folder()
        work = workload(n_smol, max_new, 49152, seed=1)
        out["ratio_smollm2"] = round(compare("smollm2-135m", smol, work, args), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
