"""The engine's log-probs equal a teacher-forced full forward of the same model (float32)."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_engine_client import EngineClient

TOL = 1e-5


def test_logprobs_match_teacher_forced_under_continuous_batching(
    server: str, reference: Any, teacher_forced: Any
) -> None:
    """Ten concurrent requests of different prompt and output lengths on four slots, so
    requests join and leave the running batch while others decode."""
    prompts = [[(7 * i + j) % 120 + 3 for j in range(1 + 4 * i)] for i in range(10)]
    lengths = [12 + 15 * i for i in range(10)]

    async def go() -> list[Any]:
        async with EngineClient(server, timeout_s=120) as c:
            return await asyncio.gather(
                *[
                    c.generate(p, {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": i})
                    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
                ]
            )

    results = asyncio.run(go())
    worst = 0.0
    for p, n, r in zip(prompts, lengths, results, strict=True):
        assert len(r.output_ids) == n
        ref = teacher_forced(reference, p, r.output_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True)))
    print(f"worst {worst:.3g}")
    assert worst < TOL, f"max |engine - teacher-forced| = {worst:.3g}"


def test_moe_logprobs_match_teacher_forced_under_continuous_batching(
    tmp_path: Any, make_model: Any, teacher_forced: Any
) -> None:
    """A mixture-of-experts model (Qwen3-MoE, fused experts, one dense layer) served by a live
    server: eight concurrent requests on four slots, each token routed to its own experts."""
    import torch
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from transformers import AutoModelForCausalLM

    path = make_model(tmp_path / "moe", family="qwen3_moe")
    opts = EmbeddedEngineConfig(
        max_running_requests=4, context_length=200, num_threads=1, startup_timeout_s=120
    )
    launcher = build(opts)
    url = launcher.launch(str(path), index=0)
    prompts = [[(11 * i + j) % 120 + 3 for j in range(2 + 5 * i)] for i in range(8)]
    lengths = [10 + 9 * i for i in range(8)]

    async def go() -> list[Any]:
        async with EngineClient(url, timeout_s=120) as c:
            return await asyncio.gather(
                *[
                    c.generate(p, {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": i})
                    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
                ]
            )

    try:
        results = asyncio.run(go())
    finally:
        launcher.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for p, n, r in zip(prompts, lengths, results, strict=True):
        assert len(r.output_ids) == n
        ref = teacher_forced(reference, p, r.output_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True)))
    assert worst < TOL, f"max |engine - teacher-forced| = {worst:.3g}"
