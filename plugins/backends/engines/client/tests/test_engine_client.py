"""The client against a live server speaking SGLang's native API (the embedded engine)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from miles_engine_client import EngineClient, EngineHTTPError, GenerateResult


def test_generate_result_parses_sglang_shape() -> None:
    data = {
        "text": "hi",
        "output_ids": [5, 2],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 2, None]],
        },
    }
    r = GenerateResult.from_json(data)
    assert (r.rid, r.output_ids, r.logprobs) == ("r1", [5, 2], [-0.5, -1.5])
    assert (r.finish_reason, r.matched_stop, r.weight_version) == ("stop", 2, "7")
    assert (r.prompt_tokens, r.completion_tokens, r.text) == (3, 2, "hi")


def test_client_round_trip(engine_url: str) -> None:
    async def go() -> dict[str, Any]:
        async with EngineClient(engine_url) as c:
            out: dict[str, Any] = {}
            out["health"] = await c.health()
            out["health_gen"] = await c.health_generate()
            out["gen"] = await c.generate(
                [3, 4, 5], {"max_new_tokens": 5, "ignore_eos": True}, rid="x"
            )
            out["info"] = await c.get_model_info()
            out["server"] = await c.get_server_info()
            out["version0"] = await c.get_weight_version()
            await c.update_weight_version("42")
            out["version1"] = await c.get_weight_version()
            out["flushed"] = await c.flush_cache()
            await c.pause_generation("in_place")
            task = asyncio.create_task(c.generate([3], {"max_new_tokens": 3}, rid="held"))
            await asyncio.sleep(0.2)
            await c.abort_request("held")
            out["held"] = await task
            await c.continue_generation()
            await c.release_memory_occupation()
            await c.resume_memory_occupation()
            out["after"] = await c.generate([3], {"max_new_tokens": 1})
            with pytest.raises(EngineHTTPError) as err:
                await c.generate([10_000], {"max_new_tokens": 1})
            out["err"] = err.value
            with pytest.raises(EngineHTTPError):
                await c.update_weights_from_disk("/no/such/folder")
            return out

    out = asyncio.run(go())
    assert out["health"] and out["health_gen"]
    gen = out["gen"]
    assert gen.rid == "x" and len(gen.output_ids) == 5 and len(gen.logprobs) == 5
    assert gen.finish_reason == "length" and gen.weight_version == out["version0"]
    assert out["info"]["is_generation"] is True
    assert out["info"]["weight_version"] == out["version0"]
    assert out["server"]["max_running_requests"] == 2
    assert out["version1"] == "42" and out["flushed"] is True
    assert out["held"].finish_reason == "abort"
    assert out["after"].weight_version == "42"
    assert out["err"].status == 400 and "vocabulary" in out["err"].message


def test_unreachable_server_is_unhealthy() -> None:
    async def go() -> tuple[bool, type[BaseException]]:
        async with EngineClient("http://127.0.0.1:9", connect_retries=1) as c:
            ok = await c.health()
            try:
                await c.generate([1])
            except Exception as exc:  # the connection error itself, after the retry
                return ok, type(exc)
            return ok, type(None)

    ok, exc = asyncio.run(go())
    assert ok is False
    import aiohttp

    assert issubclass(exc, aiohttp.ClientConnectionError)
