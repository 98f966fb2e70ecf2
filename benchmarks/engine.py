"""The embedded engine against the baselines a user would pick, and against the machine's limit.

Same model, same prompts, same sampling, same run:

* **engine**: the embedded engine as a live server, every request submitted at once, ``--batch``
  slots (continuous batching).
* **HF generate**: ``model.generate`` in static batches of ``--batch``, end-of-sequence honoured
  (a batch ends when its last request does), left padding, the SDPA attention.
* **HF generate_batch**: transformers' own continuous batching (paged KV cache,
  ``generate_batch``), its default scheduler and cache sizing, at most ``--batch`` requests at
  once.
* **roofline**: what the machine allows at this batch, measured in the same run: the time of
  one decode step's matrix products alone (every linear layer of the model at ``[batch,
  in] x [in, out]``, over separate weight copies so that none stays in cache), in the faster
  of the two layouts BLAS offers for them (``x @ W^T`` and ``(W @ x^T)^T``, which differ by
  25% at batch 16 on some CPUs; the engine chooses between the same two), which gives the
  matmul GFLOP/s at the decode shape, divided into the FLOP of a token; and the memory bound
  (the bytes of the weights and the KV cache read per step over the measured read
  bandwidth). The lower of the two is the roofline.

Workload (``--workload chat``, the default): chat prompts from eight reasoning-gym tasks
(arithmetic, counting, sorting, spelling, equations...), rendered by the ``smollm2`` family
with the generation prompt; temperature 1, top-p 1, ``--max-new`` tokens at most, the family's
stop token ends a request, so lengths fall as the model writes them. Tokens counted: every
generated token, the stop token included. ``--workload longtail`` is the older comparison
(random prompts, Pareto lengths, end-of-sequence ignored, generate vs engine only).

Prints the settings and the machine's thread count first, a line per side, and last one JSON
line with ``engine_over_hf_best``, ``engine_over_roofline`` and every figure behind them.

    .venv/bin/python benchmarks/engine.py [--threads 2] [--batch 16] [--requests 64]
        [--max-new 256] [--dtype float32] [--model smollm2|tiny] [--skip-generate-batch]
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
import torch.nn.functional as F
from _machine import describe

REPO = Path(__file__).resolve().parents[1]
TASKS = (
    "chain_sum",
    "basic_arithmetic",
    "letter_counting",
    "word_sorting",
    "spell_backward",
    "leg_counting",
    "gcd",
    "simple_equations",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF)."""
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    return smollm2_model_folder()


def tiny_folder(root: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers)."""
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


# --- workloads ------------------------------------------------------------------------------


def chat_workload(n: int, vocab: int | None) -> tuple[list[list[int]], list[int]]:
    """``n`` chat prompts (token ids) from reasoning-gym tasks, and the stop token ids.

    With ``vocab`` set (a random model), the prompts keep their lengths but their ids are
    folded into the vocabulary."""
    import reasoning_gym
    from miles_modelfamilies.smollm2 import build

    family = build()
    per_task = -(-n // len(TASKS))
    questions = []
    for t, task in enumerate(TASKS):
        data = reasoning_gym.create_dataset(task, size=per_task, seed=100 + t)
        questions += [data[i]["question"] for i in range(per_task)]
    order = random.Random(0).sample(range(len(questions)), len(questions))[:n]
    prompts = [
        family.tokenize(
            family.render([{"role": "user", "content": questions[i]}], add_generation_prompt=True)
        )
        for i in order
    ]
    stops = list(family.stop_token_ids)
    if vocab is not None:
        prompts = [[3 + x % (vocab - 3) for x in p] for p in prompts]
        stops = [2]
    return prompts, stops


def longtail_workload(
    n: int, max_new: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """``n`` (prompt, new-token length) pairs; lengths Pareto(alpha=1.2) * 16, clipped."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(max_new, max(16, 16 * rng.paretovariate(1.2))))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
        out.append((prompt, length))
    return out


# --- the sides ------------------------------------------------------------------------------


def load_hf(path: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation="sdpa"
    ).eval()


def run_generate(
    path: Path, prompts: list[list[int]], limits: list[int], stops: list[int] | None, args: Any
) -> dict[str, Any]:
    """Static batches with ``generate``. ``stops`` None: end-of-sequence ignored and each
    request gets exactly its limit (the batch runs to its longest)."""
    model = load_hf(path, args.dtype)
    model.generation_config.eos_token_id = stops
    with torch.no_grad():  # warm-up, as the engine gets one
        model.generate(
            input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=True, pad_token_id=0
        )
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        chunk, lims = prompts[i : i + args.batch], limits[i : i + args.batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(lims)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                min_new_tokens=longest if stops is None else 0,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0,
            )  # fmt: skip
        new = out[:, width:]
        for j, lim in enumerate(lims):
            tokens += _useful(new[j].tolist(), stops, lim)
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def _useful(ids: list[int], stops: list[int] | None, limit: int) -> int:
    """Generated tokens of one row: through its first stop token, at most ``limit``."""
    if stops is None:
        return min(len(ids), limit)
    for k, tok in enumerate(ids[:limit]):
        if tok in stops:
            return k + 1
    return min(len(ids), limit)


def run_generate_batch(
    path: Path, prompts: list[list[int]], stops: list[int], args: Any
) -> dict[str, Any]:
    """transformers' continuous batching (``generate_batch``, paged KV cache)."""
    import logging

    from transformers import GenerationConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = load_hf(path, args.dtype)  # generate_batch switches SDPA to its paged form
    cfg = GenerationConfig(
        max_new_tokens=args.max_new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        eos_token_id=stops, pad_token_id=0, max_batch_tokens=None,
    )  # fmt: skip
    cb_cfg = _cb_config(args.batch)
    with torch.no_grad():
        model.generate_batch(inputs=[[3, 4, 5]], generation_config=cfg, max_new_tokens=4)
        t0 = time.perf_counter()
        out = model.generate_batch(
            inputs=prompts, generation_config=cfg, continuous_batching_config=cb_cfg
        )
        dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": dt}


def _cb_config(batch: int) -> Any:
    """At most ``batch`` requests at once; the rest of its settings at their defaults."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(max_requests_per_batch=batch)


def run_engine(
    path: Path, prompts: list[list[int]], limits: list[int], stops: list[int] | None, args: Any
) -> dict[str, Any]:
    """All requests at once against a live embedded server."""
    sys.path[:0] = [
        str(REPO / "plugins/backends/engines/embedded"),
        str(REPO / "plugins/backends/engines/client"),
    ]
    from miles_engine_client import EngineClient
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=args.batch, num_threads=args.threads, dtype=args.dtype,
            context_length=1024,
        )
    )  # fmt: skip
    url = launcher.launch(str(path), index=0)

    async def go() -> dict[str, Any]:
        async with EngineClient(url, timeout_s=3600) as c:
            await c.generate([3, 4, 5], {"max_new_tokens": 4})  # warm-up
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *[
                    c.generate(
                        p,
                        {
                            "max_new_tokens": n,
                            "ignore_eos": stops is None,
                            "stop_token_ids": stops or [],
                            "temperature": 1.0,
                            "top_p": 1.0,
                            # one seed per request: the same lengths every run, whatever
                            # order the requests arrive in
                            "sampling_seed": i,
                        },
                        return_logprob=True,
                    )
                    for i, (p, n) in enumerate(zip(prompts, limits, strict=True))
                ]
            )
            dt = time.perf_counter() - t0
            return {"tokens": sum(len(r.output_ids) for r in results), "seconds": dt}

    try:
        return asyncio.run(go())
    finally:
        launcher.shutdown()


# --- the machine's limit ----------------------------------------------------------------------


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def roofline(path: Path, batch: int, dtype: str, context: float) -> dict[str, Any]:
    """The decode roofline of the model at ``batch`` sequences of mean length ``context``."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    dt = DTYPES[dtype]
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    shapes = [(h, (heads + 2 * kv) * hd), (heads * hd, h), (h, 2 * inter), (inter, h)] * layers
    shapes.append((h, cfg.vocab_size))  # the output head
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dt) for i, o in shapes]
    xs = {i: torch.randn(batch, i, generator=gen).to(dt) for i, _ in shapes}

    def step() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def step_transposed() -> None:  # the same products with the weight as left operand
        for w in weights:
            torch.mm(w, xs[w.shape[1]].t())

    step()
    step_transposed()
    t_linear, t_transposed = _best(step, 5), _best(step_transposed, 5)
    t_mm = min(t_linear, t_transposed)
    flop_mm = sum(2 * batch * i * o for i, o in shapes)
    attn_flop_token = 4 * layers * heads * hd * context  # q.k and p.v over the context
    flop_token = flop_mm / batch + attn_flop_token
    gflops = flop_mm / t_mm / 1e9
    compute_tok_s = gflops * 1e9 / flop_token

    buf = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, far past any cache
    buf.sum()
    t_read = _best(lambda: buf.sum(), 5)
    read_gb_s = buf.numel() * 4 / t_read / 1e9
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    kv_bytes = 2 * layers * kv * hd * context * batch * torch.finfo(dt).bits / 8
    memory_tok_s = batch * read_gb_s * 1e9 / (weight_bytes + kv_bytes)
    return {
        "matmul_gflops_at_decode_shape": round(gflops, 1),
        "matmul_gflops_linear": round(flop_mm / t_linear / 1e9, 1),
        "matmul_gflops_transposed": round(flop_mm / t_transposed / 1e9, 1),
        "gflop_per_token": round(flop_token / 1e9, 4),
        "compute_bound_tok_s": round(compute_tok_s, 1),
        "read_gb_s": round(read_gb_s, 2),
        "mb_read_per_step": round((weight_bytes + kv_bytes) / 1e6, 1),
        "memory_bound_tok_s": round(memory_tok_s, 1),
        "roofline_tok_s": round(min(compute_tok_s, memory_tok_s), 1),
        "mean_context": round(context, 1),
    }


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--workload", choices=("chat", "longtail"), default="chat")
    p.add_argument("--threads", type=int, default=2, help="torch threads (every side)")
    p.add_argument("--batch", type=int, default=16, help="requests at once / static batch size")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--skip-generate-batch", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    describe(vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        path = smollm2_folder() if args.model == "smollm2" else tiny_folder(Path(tmp))
        vocab = None if args.model == "smollm2" else 512
        out: dict[str, Any] = {"model": args.model, "workload": args.workload, "batch": args.batch}
        out.update(threads=args.threads, dtype=args.dtype, cpus=os.cpu_count())
        if args.workload == "longtail":
            work = longtail_workload(args.requests, args.max_new, vocab or 49152, seed=1)
            prompts, limits, stops = [w[0] for w in work], [w[1] for w in work], None
        else:
            prompts, stops = chat_workload(args.requests, vocab)
            limits = [args.max_new] * len(prompts)
        sides: dict[str, dict[str, Any]] = {}
        sides["engine"] = run_engine(path, prompts, limits, stops, args)
        _report("engine", sides["engine"])
        sides["hf_generate"] = run_generate(path, prompts, limits, stops, args)
        _report("hf_generate", sides["hf_generate"])
        if stops is not None and not args.skip_generate_batch:
            try:
                sides["hf_generate_batch"] = run_generate_batch(path, prompts, stops, args)
                _report("hf_generate_batch", sides["hf_generate_batch"])
            except Exception as exc:  # report why, keep the other figures
                out["hf_generate_batch_error"] = repr(exc)[:300]
                print(f"hf_generate_batch: failed: {exc!r}", flush=True)
        rates = {k: v["tokens"] / v["seconds"] for k, v in sides.items()}
        for k, v in sides.items():
            out[f"{k}_tok_s"] = round(rates[k], 2)
            out[f"{k}_tokens"] = v["tokens"]
        best = max((k for k in rates if k != "engine"), key=rates.__getitem__)
        out["hf_best"] = best
        out["engine_over_hf_best"] = round(rates["engine"] / rates[best], 3)
        mean_prompt = sum(len(x) for x in prompts) / len(prompts)
        mean_new = sides["engine"]["tokens"] / len(prompts)
        roof = roofline(path, args.batch, args.dtype, mean_prompt + mean_new / 2)
        print(f"roofline: {roof}", flush=True)
        out["roofline"] = roof
        out["engine_over_roofline"] = round(rates["engine"] / roof["roofline_tok_s"], 3)
    print(json.dumps(out))


def _report(name: str, side: dict[str, Any]) -> None:
    print(
        f"{name}: {side['tokens']} tokens in {side['seconds']:.1f} s = "
        f"{side['tokens'] / side['seconds']:.1f} tok/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
