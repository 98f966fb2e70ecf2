"""Generation through sglang-router vs straight to the engines, same engines, same run.

Two embedded engines serve one random Llama: by default of SmolLM2-135M's shape (30 layers,
hidden 576, vocabulary 49,152; random weights, nothing downloaded), the model the main job
trains; ``--shape tiny`` (2 layers, hidden 256, vocabulary 512) makes every request so cheap
that the router's own CPU time per request, taken from the same two cores as the engines, is a
visible part of each round (its worst case here). The workload is N requests sent at once
(prompts of 8-32 tokens, ``max_new_tokens`` new tokens each, end-of-sequence ignored, seeded
sampling). The *direct* arm sends request i to engine i mod 2 (client-side round-robin); the
*router* arm sends every request to one ``sglang-router`` in front of the same two engines
(the ``sglang`` router component, policy ``--policy``). The arms alternate (ABBA order) for
``--repeats`` rounds after one warm-up each; each arm's throughput is its useful tokens over its
wall time, summed over its rounds; ``router_engine_share`` is the part of the router arm's
tokens each engine generated. Prints every round and, last, one JSON line with
``router_over_direct`` (router tokens/s over direct tokens/s), the per-round figures and the
setting.

    .venv/bin/python benchmarks/router.py [--shape smollm2|tiny] [--requests 64]
        [--new-tokens 32] [--repeats 4] [--policy round_robin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "plugins/backends/engines/embedded"),
    str(ROOT / "plugins/backends/engines/client"),
]

#: Llama shapes: SmolLM2-135M's (the main job's model) and a tiny one.
SHAPES = {
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
}  # fmt: skip


def model_folder(root: Path, shape: str) -> Path:
    """A random Llama of ``shape`` saved as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    path = root / shape
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def workload(n: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of 8-32 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]


async def run_arm(urls: list[str], prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Send every prompt at once, prompt i to ``urls[i % len(urls)]``; (useful tokens, s)."""
    from miles_engine_client import EngineClient

    clients = [EngineClient(u, timeout_s=600, max_connections=1024) for u in urls]
    try:
        params = {"max_new_tokens": new_tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[
                clients[i % len(clients)].generate(p, dict(params, sampling_seed=i))
                for i, p in enumerate(prompts)
            ]
        )
        dt = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    for r in results:
        assert len(r.output_ids) == new_tokens and r.finish_reason == "length", r
    return sum(len(r.output_ids) for r in results), dt


def generated(urls: list[str]) -> list[int]:
    """Tokens each engine has generated since it started (its ``/get_server_info``)."""
    out = []
    for url in urls:
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
            out.append(int(json.load(resp)["internal_states"][0]["generated_tokens"]))
    return out


def main() -> None:
    """Run the benchmark and print the ratio."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="requests per round, sent at once")
    p.add_argument("--new-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=4, help="rounds of each arm")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="model shape")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--policy", default="round_robin", help="the router's policy")
    args = p.parse_args()
    describe(vars(args))

    from miles_engine_client.plugin import SglangRouterOptions
    from miles_engine_client.sglang_router import SglangRouter
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    per_engine = (args.requests + 1) // 2
    vocab = SHAPES[args.shape]["vocab_size"]
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=per_engine, num_threads=args.threads, context_length=512
        )
    )
    router = SglangRouter(SglangRouterOptions(policy=args.policy))
    direct: list[float] = []
    routed: list[float] = []
    totals = {"direct": [0, 0.0], "router": [0, 0.0]}
    served = [0, 0]  # tokens each engine generated in the router's rounds
    with tempfile.TemporaryDirectory() as tmp:
        path = str(model_folder(Path(tmp), args.shape))
        try:
            engines = [launcher.launch(path, index=i) for i in range(2)]
            router_url = router.start(engines)
            arms = {"direct": engines, "router": [router_url]}
            for urls in arms.values():  # warm-up: connections, first batches
                asyncio.run(run_arm(urls, workload(16, 99, vocab), 4))
            for rnd in range(args.repeats):
                order = ["direct", "router"] if rnd % 2 == 0 else ["router", "direct"]
                for name in order:
                    before = generated(engines)
                    tokens, dt = asyncio.run(
                        run_arm(arms[name], workload(args.requests, rnd, vocab), args.new_tokens)
                    )
                    if name == "router":
                        after = generated(engines)
                        served = [s + a - b for s, a, b in zip(served, after, before, strict=True)]
                    (direct if name == "direct" else routed).append(tokens / dt)
                    totals[name][0] += tokens
                    totals[name][1] += dt
                    print(
                        f"round {rnd} {name:>6}: {tokens} tokens in {dt:.2f} s = "
                        f"{tokens / dt:.1f} tok/s",
                        flush=True,
                    )
            assert router.alive(), "the router died during the benchmark"
        finally:
            router.stop()
            launcher.shutdown()

    tok_s = {k: t / s for k, (t, s) in totals.items()}
    ratio = tok_s["router"] / tok_s["direct"]
    print(
        f"direct {tok_s['direct']:.1f} tok/s | router {tok_s['router']:.1f} tok/s | "
        f"router/direct {ratio:.3f} (median of rounds "
        f"{statistics.median(routed) / statistics.median(direct):.3f})",
        flush=True,
    )
    out = {
        "router_over_direct": round(ratio, 3),
        "direct_tok_s": round(tok_s["direct"], 1),
        "router_tok_s": round(tok_s["router"], 1),
        "direct_rounds_tok_s": [round(x, 1) for x in direct],
        "router_rounds_tok_s": [round(x, 1) for x in routed],
        "router_engine_share": [round(x / max(1, sum(served)), 3) for x in served],
        "setting": {
            "engines": 2,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "model": f"random llama of {args.shape}'s shape: "
            + ", ".join(f"{k} {v}" for k, v in SHAPES[args.shape].items()),
            "threads": os.cpu_count(),
            "threads_per_engine": args.threads,
            "max_running_per_engine": per_engine,
            "policy": args.policy,
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
