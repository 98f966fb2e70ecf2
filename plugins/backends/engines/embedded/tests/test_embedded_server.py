"""The embedded server through the real client: generation, sampling, batching, control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from miles_engine_client import EngineClient, EngineHTTPError

T = TypeVar("T")
EOS = 2


def run(url: str, fn: Callable[[EngineClient], Awaitable[T]]) -> T:
    """Run ``fn(client)`` in a fresh event loop with a fresh client."""

    async def main() -> T:
        async with EngineClient(url, timeout_s=120) as c:
            return await fn(c)

    return asyncio.run(main())


async def wait_for(c: EngineClient, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the scheduler state until ``pred`` holds (10 s at most)."""
    for _ in range(400):
        state = (await c.get_server_info())["internal_states"][0]
        if pred(state):
            return state
        await asyncio.sleep(0.025)
    raise AssertionError(f"scheduler never reached the state; last {state}")


def test_generate_response_shape(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        return await c.request(
            "POST",
            "/generate",
            {
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
                "return_logprob": True,
                "rid": "shape-1",
            },
        )

    data = run(server, go)
    assert len(data["output_ids"]) == 6
    meta = data["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
    assert isinstance(meta["weight_version"], str)
    lps = meta["output_token_logprobs"]
    assert [x[1] for x in lps] == data["output_ids"]
    assert all(x[0] <= 0.0 and x[2] is None for x in lps)


def test_batch_input_ids(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        return await c.request(
            "POST",
            "/generate",
            {
                "input_ids": [[5, 6], [7, 8, 9]],
                "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4}],
                "rid": ["b-1", "b-2"],
            },
        )

    out = run(server, go)
    assert [o["meta_info"]["id"] for o in out] == ["b-1", "b-2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]


def test_same_seed_same_tokens_and_greedy_matches_hf(server: str, reference: Any) -> None:
    import torch

    prompt = [10, 11, 12, 13]
    sp = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 1234}

    async def go(c: EngineClient) -> Any:
        a, b, other = await asyncio.gather(
            c.generate(prompt, sp),
            c.generate(prompt, sp),
            c.generate(prompt, {**sp, "sampling_seed": 99}),
        )
        greedy = await c.generate(
            prompt, {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}
        )
        top1 = await c.generate(prompt, {**sp, "top_k": 1})
        topp = await c.generate(prompt, {**sp, "top_p": 1e-6})
        return a, b, other, greedy, top1, topp

    a, b, other, greedy, top1, topp = run(server, go)
    assert a.output_ids == b.output_ids
    assert a.output_ids != other.output_ids
    with torch.no_grad():
        hf = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert greedy.output_ids == hf[0, len(prompt) :].tolist()
    assert top1.output_ids == greedy.output_ids
    assert topp.output_ids == greedy.output_ids


def test_stop_token_ids_and_eos(server: str) -> None:
    prompt = [20, 21, 22]
    base = {"max_new_tokens": 150, "ignore_eos": True, "temperature": 1.0}

    async def go(c: EngineClient) -> Any:
        first = await c.generate(prompt, {**base, "sampling_seed": 7})
        stop_tok = first.output_ids[5]
        stopped = await c.generate(
            prompt, {**base, "sampling_seed": 7, "stop_token_ids": [stop_tok]}
        )
        # Find a seed whose ignore_eos run contains EOS, then run it without ignore_eos.
        for seed in range(40):
            r = await c.generate(prompt, {**base, "sampling_seed": seed})
            if EOS in r.output_ids:
                eos_run = await c.generate(
                    prompt, {**base, "sampling_seed": seed, "ignore_eos": False}
                )
                return first, stop_tok, stopped, r, eos_run
        raise AssertionError("no sampled EOS in 40 seeds")

    first, stop_tok, stopped, with_eos, eos_run = run(server, go)
    cut = first.output_ids.index(stop_tok) + 1
    assert stopped.output_ids == first.output_ids[:cut]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop_tok
    cut = with_eos.output_ids.index(EOS) + 1
    assert eos_run.output_ids == with_eos.output_ids[:cut]
    assert eos_run.finish_reason == "stop" and eos_run.matched_stop == EOS


def test_length_limits(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        zero = await c.generate([5, 6], {"max_new_tokens": 0})
        # context_length is 200: a 190-token prompt leaves room for 10 new tokens.
        clipped = await c.generate([7] * 190, {"max_new_tokens": 100, "ignore_eos": True})
        return zero, clipped

    zero, clipped = run(server, go)
    assert zero.output_ids == [] and zero.finish_reason == "length"
    assert len(clipped.output_ids) == 10 and clipped.finish_reason == "length"


def test_continuous_batching_short_request_overtakes(server: str) -> None:
    """Ten requests on four slots all finish with their own lengths, and a short request
    submitted while long ones run finishes first (it joined the running batch)."""

    async def go(c: EngineClient) -> Any:
        lengths = [150, 150, 150]
        longs = [
            asyncio.create_task(
                c.generate([30 + i] * (3 + i), {"max_new_tokens": n, "ignore_eos": True})
            )
            for i, n in enumerate(lengths)
        ]
        await wait_for(c, lambda s: s["running_requests"] == 3)
        short = await c.generate([9, 9], {"max_new_tokens": 4, "ignore_eos": True})
        still_running = [not t.done() for t in longs]
        done_longs = await asyncio.gather(*longs)
        many = await asyncio.gather(
            *[
                c.generate([40, 41 + i], {"max_new_tokens": 5 + 7 * i, "ignore_eos": True})
                for i in range(10)
            ]
        )
        return short, still_running, done_longs, many

    short, still_running, done_longs, many = run(server, go)
    assert len(short.output_ids) == 4 and all(still_running)
    assert [len(r.output_ids) for r in done_longs] == [150, 150, 150]
    assert [len(r.output_ids) for r in many] == [5 + 7 * i for i in range(10)]


def test_abort_waiting_and_running(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        running = asyncio.create_task(
            c.generate([50, 51], {"max_new_tokens": 190, "ignore_eos": True}, rid="run-1")
        )
        await wait_for(c, lambda s: s["running_requests"] == 1)
        await c.pause_generation("in_place")
        waiting = asyncio.create_task(c.generate([52], {"max_new_tokens": 5}, rid="wait-1"))
        await wait_for(c, lambda s: s["waiting_requests"] == 1)
        await c.abort_request("wait-1")
        w = await waiting
        await c.abort_request("run-1")
        r = await running
        await c.continue_generation()
        return w, r

    w, r = run(server, go)
    assert w.finish_reason == "abort" and w.output_ids == []
    assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 190
    assert len(r.logprobs) == len(r.output_ids)


def test_pause_modes(server: str, reference: Any, teacher_forced: Any) -> None:
    prompt = [60, 61, 62]
    sp = {"max_new_tokens": 120, "ignore_eos": True, "sampling_seed": 5}

    async def go(c: EngineClient) -> Any:
        # in_place: a paused engine takes no step; the request finishes after continue.
        await c.pause_generation("in_place")
        held = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 3}))
        await asyncio.sleep(0.5)
        held_done_while_paused = held.done()
        steps = (await c.get_server_info())["internal_states"][0]["decode_steps"]
        await asyncio.sleep(0.3)
        steps_after = (await c.get_server_info())["internal_states"][0]["decode_steps"]
        assert await c.flush_cache() is False  # a request is waiting
        await c.continue_generation()
        held_r = await held
        # retract: the running request goes back to the queue and resumes with its tokens.
        t = asyncio.create_task(c.generate(prompt, sp))
        await wait_for(c, lambda s: s["running_requests"] == 1)
        await c.pause_generation("retract")
        state = await wait_for(c, lambda s: s["running_requests"] == 0)
        await c.continue_generation()
        retracted = await t
        # abort mode aborts what runs.
        t2 = asyncio.create_task(c.generate(prompt, {**sp, "max_new_tokens": 190}))
        await wait_for(c, lambda s: s["running_requests"] == 1)
        await c.pause_generation("abort")
        aborted = await t2
        await c.continue_generation()
        flushed = await c.flush_cache()
        return (
            held_done_while_paused,
            steps,
            steps_after,
            held_r,
            state,
            retracted,
            aborted,
            flushed,
        )

    held_paused, steps, steps_after, held_r, state, retracted, aborted, flushed = run(server, go)
    assert not held_paused and steps == steps_after
    assert len(held_r.output_ids) == 3
    assert state["waiting_requests"] == 1
    assert len(retracted.output_ids) == 120
    ref = teacher_forced(reference, prompt, retracted.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, retracted.logprobs, strict=True)) < 1e-4
    assert aborted.finish_reason == "abort"
    assert flushed is True


def test_release_and_resume_memory(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        await c.release_memory_occupation(["kv_cache"])
        s = (await c.get_server_info())["internal_states"][0]
        t = asyncio.create_task(c.generate([3, 4], {"max_new_tokens": 4}))
        await asyncio.sleep(0.3)
        waited = not t.done()
        await c.resume_memory_occupation(["kv_cache"])
        r = await t
        return s, waited, r

    s, waited, r = run(server, go)
    assert s["kv_cache_released"] and s["kv_cache_length"] == 0
    assert waited and len(r.output_ids) == 4


def test_health_and_info(server: str) -> None:
    async def go(c: EngineClient) -> Any:
        return (
            await c.health(),
            await c.health_generate(),
            await c.get_model_info(),
            await c.get_server_info(),
        )

    ok, ok_gen, model, info = run(server, go)
    assert ok and ok_gen
    assert model["is_generation"] is True and model["model_type"] == "llama"
    assert info["max_running_requests"] == 4 and info["context_length"] == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [5, 128]}, "outside the vocabulary"),
        ({"input_ids": [-1]}, "outside the vocabulary"),
        ({"input_ids": [1] * 200}, "context length"),
        ({"input_ids": [1], "bogus": 1}, "bogus"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1.5]}, "input_ids"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"text": "hello"}, "tokenizer"),
        ({}, "input_ids"),
    ],
)
def test_bad_generate_requests_are_400(server: str, body: dict[str, Any], needle: str) -> None:
    async def go(c: EngineClient) -> EngineHTTPError:
        with pytest.raises(EngineHTTPError) as info:
            await c.request("POST", "/generate", body)
        return info.value

    err = run(server, go)
    assert err.status == 400
    assert needle in err.message


def test_malformed_json_is_400(server: str) -> None:
    async def go(c: EngineClient) -> tuple[int, Any]:
        sess = c._sess()
        async with sess.post(server + "/generate", data=b"{not json") as resp:
            return resp.status, await resp.json()

    status, body = run(server, go)
    assert status == 400 and "malformed JSON" in body["error"]["message"]


def test_server_info_reports_the_matmul_plan(server: str) -> None:
    """The session server runs with ``matmul: transposed``: every row count in that layout;
    ``attention: auto`` chose the native kernel (float32 on the CPU, head_dim 16)."""

    async def go(c: EngineClient) -> Any:
        return await c.get_server_info()

    info = run(server, go)
    assert info["matmul"] == "transposed"
    assert set(info["matmul_plan"].values()) == {"transposed"}
    assert info["attention"] == "auto" and info["decode_attention"] == "native"
