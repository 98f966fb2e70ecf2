"""The scheduler in-process, on both forward paths and two families: log-probs equal a
teacher-forced transformers forward while requests join and leave the batch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("lean", [True, False])
def test_engine_logprobs_match_teacher_forced(
    tmp_path: Path, family: str, lean: bool, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from transformers import AutoModelForCausalLM

    make = request.getfixturevalue("make_model")
    path = make(tmp_path / family, family=family)
    torch.set_num_threads(1)
    from miles_engine_embedded.weights import ModelHolder

    holder = ModelHolder(
        str(path), device="cpu", dtype="float32", weight_version="0", lean_forward=lean
    )
    assert (holder.lean is not None) == lean
    engine = Engine(
        holder, max_running_requests=3, max_total_tokens=600, context_length=200, seed=0
    )
    engine.start()
    prompts = [[(5 * i + j) % 120 + 3 for j in range(2 + 6 * i)] for i in range(7)]
    lengths = [10 + 13 * i for i in range(7)]
    done: list[Request] = []
    finished = threading.Event()

    def on_done(r: Request) -> None:
        done.append(r)
        if len(done) == len(prompts):
            finished.set()

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.9, top_k=50)
        engine.submit(Request(rid=str(i), input_ids=p, params=sp, return_logprob=True,
                              on_done=on_done, uniforms=UniformStream(i)))  # fmt: skip
    assert finished.wait(120)
    engine.stop()
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for r in done:
        assert len(r.output_ids) == lengths[int(r.rid)]
        ref = teacher_forced(ref_model, r.input_ids, r.output_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True)))
    assert worst < 1e-5, worst
