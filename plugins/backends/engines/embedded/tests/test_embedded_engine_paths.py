"""The scheduler in-process, on both forward paths and two families: log-probs equal a
teacher-forced transformers forward while requests join and leave the batch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest


def collector(expected: int) -> tuple[list[Any], threading.Event, Any]:
    """``(done, finished, on_done)``: ``on_done`` collects finished requests into ``done`` and
    sets ``finished`` once ``expected`` have finished."""
    done: list[Any] = []
    finished = threading.Event()

    def on_done(r: Any) -> None:
        done.append(r)
        if len(done) == expected:
            finished.set()

    return done, finished, on_done


def assert_teacher_forced(
    path: Path, done: list[Any], teacher_forced: Any, top_k: int | None = None
) -> None:
    """Every log-prob of every finished request equals a teacher-forced transformers forward
    (with ``top_k``: over the ``top_k`` largest logits of each position, the distribution the
    engine drew from and reports)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for r in done:
        ref = teacher_forced(ref_model, r.input_ids, r.output_ids, top_k=top_k)
        worst = max(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True))
        assert worst < 1e-5, (r.rid, worst)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("lean", [True, False])
def test_engine_logprobs_match_teacher_forced(
    tmp_path: Path, family: str, lean: bool, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream

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
    done, finished, on_done = collector(len(prompts))

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.9, top_k=50)
        engine.submit(Request(rid=str(i), input_ids=p, params=sp, return_logprob=True,
                              on_done=on_done, uniforms=UniformStream(i)))  # fmt: skip
    assert finished.wait(120)
    engine.stop()
    for r in done:
        assert len(r.output_ids) == lengths[int(r.rid)]
    assert_teacher_forced(path, done, teacher_forced, top_k=50)


def test_a_group_of_one_prompt_is_prefilled_once(
    tmp_path: Path, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    """Four samples of one prompt arriving together cost one prompt's prefill; each gets the
    prompt's keys and values and its own tokens, and every log-prob still equals a
    teacher-forced forward."""
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    path = request.getfixturevalue("make_model")(tmp_path / "llama", family="llama")
    torch.set_num_threads(1)
    holder = ModelHolder(str(path), device="cpu", dtype="float32", weight_version="0")
    engine = Engine(
        holder, max_running_requests=8, max_total_tokens=800, context_length=200, seed=0
    )
    group = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    prompts = [group] * 4 + [[20, 21, 22], group[:5]]
    done, finished, on_done = collector(len(prompts))

    for i, p in enumerate(prompts):  # all queued before the scheduler starts: one prefill
        sp = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0)
        engine.submit(Request(rid=str(i), input_ids=list(p), params=sp, return_logprob=True,
                              on_done=on_done, uniforms=UniformStream(100 + i)))  # fmt: skip
    engine.start()
    assert finished.wait(120)
    engine.stop()
    assert engine.prefill_shared == 3 * len(group)
    assert engine.prefill_forwarded == len(group) + 3 + 5
    by_rid = {r.rid: r for r in done}
    outputs = {tuple(by_rid[str(i)].output_ids) for i in range(4)}
    assert len(outputs) == 4  # one prompt, four samples: each drew its own tokens
    assert_teacher_forced(path, done, teacher_forced)


def test_a_sample_arriving_later_starts_from_a_running_one(
    tmp_path: Path, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    """A sample of a prompt that a running request was prefilled from (same weights) takes
    its keys, values and first logits: no forward; after a weight update it is prefilled."""
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    path = request.getfixturevalue("make_model")(tmp_path / "qwen3", family="qwen3")
    torch.set_num_threads(1)
    holder = ModelHolder(str(path), device="cpu", dtype="float32", weight_version="0")
    engine = Engine(
        holder, max_running_requests=6, max_total_tokens=800, context_length=200, seed=0
    )
    prompt = [9, 8, 7, 6, 5, 4, 3]
    done: list[Request] = []

    def submit(i: int) -> None:
        sp = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0)
        engine._enqueue(Request(rid=str(i), input_ids=list(prompt), params=sp,
                                return_logprob=True, on_done=done.append,
                                uniforms=UniformStream(i)))  # fmt: skip

    with torch.no_grad():  # the scheduler's own thread runs without grad; so does this one
        submit(0)
        engine._admit()
        engine._decode_step()
        engine._decode_step()
        assert engine.prefill_forwarded == len(prompt) and engine.prefill_shared == 0
        submit(1)
        submit(2)
        engine._admit()  # both join the running request 0: nothing forwarded
        assert engine.prefill_forwarded == len(prompt)
        assert engine.prefill_shared == 2 * len(prompt)
        holder.weight_version = "1"  # a weight update: request 0's prefill is of other weights
        submit(3)
        engine._admit()
        assert engine.prefill_forwarded == 2 * len(prompt)
        while engine.running:
            engine._decode_step()
    assert len(done) == 4 and len({tuple(r.output_ids) for r in done}) == 4
    assert_teacher_forced(path, done, teacher_forced)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_shared_prefix_is_forwarded_once(
    tmp_path: Path, family: str, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    """Sequences that begin alike (a system prompt) forward the shared part once: one queued
    with a sequence that begins like it waits for that one's forward (the next step, packed
    with the decode rows) and starts from its keys and values; one arriving later starts from
    a running request's. Prefixes under
    ``MIN_SHARED_PREFIX`` tokens, and other weights, are forwarded whole; every log-prob
    still equals a teacher-forced forward."""
    import torch
    from miles_engine_embedded.engine import MIN_SHARED_PREFIX, Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    path = request.getfixturevalue("make_model")(tmp_path / family, family=family)
    torch.set_num_threads(1)
    holder = ModelHolder(str(path), device="cpu", dtype="float32", weight_version="0")
    engine = Engine(
        holder, max_running_requests=8, max_total_tokens=1600, context_length=200, seed=0
    )
    system = list(range(40, 50))
    assert len(system) >= MIN_SHARED_PREFIX
    done: list[Request] = []

    def submit(i: int, prompt: list[int]) -> None:
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0)
        engine._enqueue(Request(rid=str(i), input_ids=prompt, params=sp, return_logprob=True,
                                on_done=done.append, uniforms=UniformStream(i)))  # fmt: skip

    with torch.no_grad():
        submit(0, [*system, 1, 2, 3])
        submit(1, [70, 71, 72])
        submit(2, [*system, 4, 5, 6, 7])  # waits for 0, then forwards 4 tokens
        submit(3, [*system[:9], 60])  # 9 shared: forwards 1 token
        submit(4, [*system[: MIN_SHARED_PREFIX - 1], 61, 62])  # too short a prefix: whole
        assert not engine._admit()  # nothing was running: no decode rows
        assert engine.prefill_forwarded == 13 + 3 + MIN_SHARED_PREFIX + 1
        assert engine.prefill_shared == 0 and [r.rid for r in engine.waiting] == ["2", "3"]
        assert engine._admit()  # packed with the first decode step of 0, 1 and 4
        assert engine.prefill_forwarded == 13 + 3 + MIN_SHARED_PREFIX + 1 + 4 + 1
        assert engine.prefill_shared == 10 + 9 and engine.steps == 1
        engine._decode_step()
        engine._decode_step()
        submit(5, [*system, 8, 9])  # from a running request: forwards 2 tokens
        engine._admit()
        assert engine.prefill_shared == 10 + 9 + 10
        holder.weight_version = "1"  # a weight update: nothing running holds these weights
        submit(6, [*system, 9, 8])
        engine._admit()
        assert engine.prefill_shared == 10 + 9 + 10
        while engine.running:
            engine._decode_step()
    assert len(done) == 7 and all(len(r.output_ids) == 8 for r in done)
    assert_teacher_forced(path, done, teacher_forced)


def test_a_late_start_and_a_long_sequence_are_packed_each_over_its_own_positions(
    tmp_path: Path, teacher_forced: Any, request: pytest.FixtureRequest
) -> None:
    """A sequence starting late (a long shared prefix) and a long one from the start need
    more positions together than the cache has (a padded forward of both would not fit):
    packed, each runs over its own positions only."""
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    path = request.getfixturevalue("make_model")(tmp_path / "llama", family="llama")
    torch.set_num_threads(1)
    holder = ModelHolder(str(path), device="cpu", dtype="float32", weight_version="0")
    engine = Engine(holder, max_running_requests=4, max_total_tokens=400, context_length=48,
                    seed=0)  # fmt: skip
    done: list[Request] = []

    def submit(i: int, prompt: list[int]) -> None:
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=1.0)
        engine._enqueue(Request(rid=str(i), input_ids=prompt, params=sp, return_logprob=True,
                                on_done=done.append, uniforms=UniformStream(i)))  # fmt: skip

    long_prefix = [(7 * j) % 100 + 3 for j in range(30)]
    with torch.no_grad():
        submit(0, [*long_prefix, 1])
        engine._admit()
        submit(1, [*long_prefix, 2, 3])  # starts at 30, forwards 2
        submit(2, [(11 * j) % 90 + 5 for j in range(40)])  # from 0, forwards 40: 30 + 40 > 48
        assert engine._admit()  # packed with request 0's decode row
        assert engine.prefill_shared == 30 and len(engine.running) == 3
        assert engine.prefill_forwarded == 31 + 2 + 40
        while engine.running:
            engine._decode_step()
    assert len(done) == 3 and all(r.finish_reason["type"] == "length" for r in done)
    assert_teacher_forced(path, done, teacher_forced)


def test_the_lean_forwards_rewritten_steps_equal_the_originals_bitwise() -> None:
    """The lean forward's rotation (a roll against a sine with its first half negated), its
    additive attention mask (made once per forward) and the cache's flat-index writes give
    exactly what transformers' ``rotate_half``, a boolean mask and per-slot indexing give."""
    import torch
    import torch.nn.functional as F
    from miles_engine_embedded.fast_forward import _rotate
    from miles_engine_embedded.kv_cache import SlotKVCache, additive
    from transformers.models.llama.modeling_llama import rotate_half

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, 4, 64, generator=gen)
    cos, sin = torch.randn(5, 1, 1, 64, generator=gen), torch.randn(5, 1, 1, 64, generator=gen)
    signed = torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1)
    assert torch.equal(_rotate(x, cos, signed), x * cos + rotate_half(x) * sin)

    q, k, v = (torch.randn(5, 3, 3, 64, generator=gen) for _ in range(3))
    seen = torch.arange(3).view(1, 1, 1, 3) <= torch.tensor([0, 1, 2, 2, 1]).view(5, 1, 1, 1)
    assert torch.equal(
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive(seen, torch.float32)),
        F.scaled_dot_product_attention(q, k, v, attn_mask=seen),
    )

    cache = SlotKVCache(num_layers=1, num_slots=4, num_kv_heads=3, head_dim=8, max_length=32,
                        dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    cache.ensure(20)
    positions = torch.tensor([7, 0, 19])
    cache.prepare_decode(positions, 20)
    new_k, new_v = torch.randn(3, 3, 1, 8, generator=gen), torch.randn(3, 3, 1, 8, generator=gen)
    cache.update(new_k, new_v, 0)
    for slot, pos in enumerate(positions.tolist()):
        assert torch.equal(cache.keys[0][slot, :, pos], new_k[slot, :, 0])
        assert torch.equal(cache.values[0][slot, :, pos], new_v[slot, :, 0])
    assert int((cache.keys[0] != 0).sum()) == 3 * 3 * 8  # nothing else written
