"""Input (prompt) log-probs: SGLang's scoring path of ``POST /generate`` (``return_logprob``,
``logprob_start_len``, ``max_new_tokens: 0``), on the live server and in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from miles_engine_client import EngineClient

TOL = 1e-5


def _post(server: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=server, timeout=60, trust_env=False) as http:
        return http.post("/generate", json=body)


def _score_body(ids: list[int], start: int, **sampling: Any) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, **sampling},
        "return_logprob": True,
        "logprob_start_len": start,
    }


def test_scored_logprobs_equal_the_generated_ones_while_others_decode(server: str) -> None:
    """Five sampled generations of different lengths are scored at once (one batch) while
    three long requests decode: each scored log-prob equals the one the token was sampled
    with, and the decoding requests draw the tokens they draw without scoring beside them."""
    prompts = [[(3 * i + j) % 120 + 3 for j in range(2 + 5 * i)] for i in range(5)]
    lengths = [6 + 9 * i for i in range(5)]
    busy = [[40 + i, 41, 42] for i in range(3)]

    def gen(c: EngineClient, p: list[int], n: int, seed: int) -> Any:
        return c.generate(p, {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": seed})

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with EngineClient(server, timeout_s=120) as c:
            out["samples"] = await asyncio.gather(
                *(gen(c, p, n, i) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
            )
            out["alone"] = await asyncio.gather(
                *(gen(c, p, 190, 50 + i) for i, p in enumerate(busy))
            )
            before = (await c.get_server_info())["internal_states"][0]
            decoding = [asyncio.create_task(gen(c, p, 190, 50 + i)) for i, p in enumerate(busy)]
            while not all(t.done() for t in decoding):  # until all three are running
                state = (await c.get_server_info())["internal_states"][0]
                if state["running_requests"] == 3:
                    break
                await asyncio.sleep(0.005)
            out["scored"] = await asyncio.gather(
                *(
                    c.input_logprobs(p + s.output_ids, start=len(p))
                    for p, s in zip(prompts, out["samples"], strict=True)
                )
            )
            out["still_decoding"] = sum(not t.done() for t in decoding)
            out["beside"] = await asyncio.gather(*decoding)
            after = (await c.get_server_info())["internal_states"][0]
            out["forwarded"] = after["score_tokens_forwarded"] - before["score_tokens_forwarded"]
        return out

    o = asyncio.run(go())
    worst = 0.0
    for s, lps, n in zip(o["samples"], o["scored"], lengths, strict=True):
        assert len(s.output_ids) == n and len(lps) == n
        worst = max(worst, *(abs(a - b) for a, b in zip(lps, s.logprobs, strict=True)))
    print(f"worst {worst:.3g}")
    assert worst < TOL, f"max |scored - sampled| = {worst:.3g}"
    # The three decodes started together and run 190 steps each; the scores must come back
    # while they still run, not after them. On a loaded machine the client can see the last of
    # the three finish first, so one still running is what is required.
    assert o["still_decoding"] >= 1, "the scoring requests were not answered while others ran"
    # each input forwarded once (padding not counted)
    assert o["forwarded"] == sum(len(p) + n for p, n in zip(prompts, lengths, strict=True))
    for beside, alone in zip(o["beside"], o["alone"], strict=True):
        assert beside.output_ids == alone.output_ids
        assert beside.logprobs == pytest.approx(alone.logprobs, abs=TOL)


def test_start_zero_minus_one_and_out_of_range(server: str, reference: Any) -> None:
    """``logprob_start_len`` 0: one entry per input token, the first null; -1: none; at or past
    the input's length, or below -1: a 400 naming the field. The values equal a full
    teacher-forced forward."""
    import torch

    ids = [5, 9, 17, 33, 2, 64]
    r0 = _post(server, _score_body(ids, 0))
    assert r0.status_code == 200, r0.text
    body = r0.json()
    meta = body["meta_info"]
    assert body["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and meta["prompt_tokens"] == len(ids)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and all(e[2] is None for e in entries)
    assert entries[0][0] is None
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    worst = max(abs(e[0] - x) for e, x in zip(entries[1:], ref.squeeze(1).tolist(), strict=True))
    assert worst < TOL, worst

    r3 = _post(server, _score_body(ids, 3)).json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in r3] == ids[3:]
    assert [e[0] for e in r3] == pytest.approx([e[0] for e in entries[3:]], abs=TOL)

    none = _post(server, _score_body(ids, -1))
    assert none.status_code == 200 and none.json()["meta_info"]["input_token_logprobs"] == []
    for bad in (len(ids), len(ids) + 5, -2):
        resp = _post(server, _score_body(ids, bad))
        assert resp.status_code == 400, (bad, resp.text)
        assert "logprob_start_len" in resp.json()["error"]["message"], resp.text
    # without return_logprob the field is ignored, as SGLang ignores it
    plain = _post(server, {**_score_body(ids, len(ids)), "return_logprob": False})
    assert plain.status_code == 200, plain.text
    single = _post(server, _score_body([7], 0)).json()["meta_info"]["input_token_logprobs"]
    assert single == [[None, 7, None]]


def test_scoring_and_generating_in_one_request(server: str) -> None:
    """``max_new_tokens > 0`` with ``logprob_start_len``: both the input and the output
    log-probs; the output is what the same request draws without scoring."""
    ids = [11, 12, 13, 14, 15, 16, 17]
    sp = {"max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 3}
    both = _post(server, {**_score_body(ids, 2), "sampling_params": sp}).json()
    plain = _post(server, {"input_ids": ids, "sampling_params": sp, "return_logprob": True})
    plain_meta = plain.json()["meta_info"]
    meta = both["meta_info"]
    assert both["output_ids"] == plain.json()["output_ids"] and len(both["output_ids"]) == 9
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in plain_meta["output_token_logprobs"]], abs=TOL
    )
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[2:]
    assert all(e[0] is not None for e in meta["input_token_logprobs"])
    assert plain_meta["input_token_logprobs"] == []
    alone = _post(server, _score_body(ids, 2)).json()["meta_info"]["input_token_logprobs"]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in alone], abs=TOL
    )


def test_client_input_logprobs_and_its_refusals(server: str) -> None:
    """The client returns one log-prob per position ``start..len-1`` (the last position
    alone, none at ``start == len``) and refuses a ``start`` below 1 before sending."""

    async def go() -> tuple[list[float], list[float], list[float], int]:
        async with EngineClient(server, timeout_s=60) as c:
            ids = [4, 8, 15, 16, 23, 42]
            full = await c.input_logprobs(ids, start=1)
            last = await c.input_logprobs(ids, start=5)
            empty = await c.input_logprobs(ids, start=6)
            for bad in (0, -3, 7):
                with pytest.raises(ValueError, match="start must be in"):
                    await c.input_logprobs(ids, start=bad)
            return full, last, empty, len(ids)

    full, last, empty, n = asyncio.run(go())
    assert len(full) == n - 1 and last == pytest.approx(full[-1:], abs=TOL) and empty == []
    assert all(x <= 0.0 for x in full)


def test_scoring_waits_while_paused_and_can_be_aborted(server: str) -> None:
    """A scoring request waits while generation is paused (and after a memory release), and
    is answered after ``continue_generation``; one aborted by rid ends with ``abort`` and
    no input log-probs."""
    ids = list(range(3, 40))

    async def go() -> tuple[bool, bool, Any, Any]:
        async with EngineClient(server, timeout_s=60) as c:
            await c.pause_generation("in_place")
            try:
                held = asyncio.create_task(c.input_logprobs(ids, start=4))
                doomed = asyncio.create_task(
                    c.request("POST", "/generate", {**_score_body(ids, 1), "rid": "score-x"})
                )
                await asyncio.sleep(0.4)
                waited = not held.done() and not doomed.done()
                await c.abort_request("score-x")
                aborted = await asyncio.wait_for(doomed, 30)
                await c.release_memory_occupation()
                await c.continue_generation()
                await asyncio.sleep(0.4)
                waited_released = not held.done()
            finally:
                await c.continue_generation()
                await c.resume_memory_occupation()
            return waited, waited_released, aborted, await asyncio.wait_for(held, 30)

    waited, waited_released, aborted, scored = asyncio.run(go())
    assert waited, "a scoring request was answered while paused"
    assert waited_released, "a scoring request was answered while the memory was released"
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["input_token_logprobs"] == []
    assert len(scored) == len(ids) - 4


@pytest.mark.parametrize("lean", [True, False])
def test_scoring_takes_no_slot_and_batches_under_the_token_budget(
    tmp_path: Path, lean: bool, request: pytest.FixtureRequest
) -> None:
    """In-process, on both forward paths: scoring requests queued together are forwarded in
    as few padded forwards as ``prefill_tokens`` allows, beside a running request whose slot
    and keys stay untouched; scoring alone never allocates the KV cache."""
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    path = request.getfixturevalue("make_model")(tmp_path / "qwen3", family="qwen3")
    torch.set_num_threads(1)
    holder = ModelHolder(
        str(path), device="cpu", dtype="float32", weight_version="0", lean_forward=lean
    )
    engine = Engine(
        holder, max_running_requests=2, max_total_tokens=400, context_length=200, seed=0
    )
    engine.prefill_tokens = 60  # three of the 20-token inputs per forward
    done: list[Request] = []  # the scheduler thread is not started: all runs here

    def req(rid: str, ids: list[int], start: int, n: int = 0) -> Request:
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
        return Request(rid=rid, input_ids=ids, params=sp, return_logprob=True,
                       logprob_start_len=start, on_done=done.append,
                       uniforms=UniformStream(0))  # fmt: skip

    inputs = [[(7 * i + j) % 120 + 3 for j in range(20 - i)] for i in range(7)]
    shapes: list[tuple[int, ...]] = []
    real_forward = holder.forward

    def counting(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(ids.shape))
        return real_forward(ids, *args, **kwargs)

    with torch.no_grad():  # the scheduler's own thread runs without grad; so does this one
        assert not engine.cache.allocated
        engine._enqueue(req("alone", inputs[0], 0))
        engine._score()
        assert not engine.cache.allocated and done[-1].rid == "alone"
        engine._enqueue(req("run", [9, 8, 7], -1, n=30))
        engine._admit()
        engine._decode_step()
        keys = [k[0, :, :5].clone() for k in engine.cache.keys]
        holder.forward = counting  # type: ignore[method-assign]
        for i, ids in enumerate(inputs):
            engine._enqueue(req(f"s{i}", ids, 1 + i % 3))
        engine._score()
        holder.forward = real_forward  # type: ignore[method-assign]
        # longest first, at most 60 padded tokens a forward: 3 x 20, 3 x 17, 1 x 14
        assert shapes == [(3, 20), (3, 17), (1, 14)], shapes
        assert engine.score_forwarded == sum(len(x) for x in inputs) + len(inputs[0])
        assert [r.rid for r in engine.running] == ["run"] and not engine.scoring
        after = [k[0, :, :5] for k in engine.cache.keys]
        assert all(torch.equal(a, b) for a, b in zip(after, keys, strict=True))
        # a request that scores and generates joins the generation queue once scored
        engine._enqueue(req("both", inputs[1], 2, n=4))
        engine._score()
        assert [r.rid for r in engine.waiting] == ["both"]
        while engine.running or engine.waiting:
            engine._admit()
            engine._decode_step()
        by_rid = {r.rid: r for r in done}
        for i, ids in enumerate(inputs):
            r, start = by_rid[f"s{i}"], 1 + i % 3
            assert r.finish_reason == {"type": "length", "length": 0} and not r.output_ids
            logits = holder.model(torch.tensor([ids])).logits[0].float()
            want = torch.log_softmax(logits[start - 1 : -1], -1)
            want = want.gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1).tolist()
            assert len(r.input_logprobs) == len(ids) - start
            assert max(abs(a - b) for a, b in zip(r.input_logprobs, want, strict=True)) < TOL
    assert by_rid["alone"].input_logprobs[0] is None
    assert len(by_rid["alone"].input_logprobs) == len(inputs[0])
    assert len(by_rid["both"].output_ids) == 4 and len(by_rid["both"].input_logprobs) == 17
    assert len(by_rid["run"].output_ids) == 30
