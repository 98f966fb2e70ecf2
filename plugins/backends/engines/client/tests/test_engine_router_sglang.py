"""The ``sglang`` router (a real ``sglang-router`` process) over two real embedded engines.

Each engine is given its own weight version, so the ``weight_version`` of an answer says which
engine produced it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles_engine_client import EngineClient, EngineHTTPError, GenerateResult
from miles_engine_client.plugin import SglangRouterOptions
from miles_engine_client.sglang_router import RouterError, SglangRouter

pytestmark = pytest.mark.slow

VERSIONS = ("engine-a", "engine-b")


@pytest.fixture(scope="module")
def engines(two_engines: list[str]) -> list[str]:
    """Two engines over the same tiny model, weight versions ``engine-a`` and ``engine-b``."""

    async def name() -> None:
        for url, version in zip(two_engines, VERSIONS, strict=True):
            async with EngineClient(url) as c:
                await c.update_weight_version(version)

    asyncio.run(name())
    return two_engines


@pytest.fixture
def router(tmp_path: Path) -> Iterator[SglangRouter]:
    r = SglangRouter(
        SglangRouterOptions(policy="round_robin", startup_timeout_s=30, log_dir=str(tmp_path))
    )
    try:
        yield r
    finally:
        r.stop()


def generate(url: str, n: int, tag: str, *, one_by_one: bool = False) -> list[dict[str, Any]]:
    """``n`` seeded requests to ``url``, all at once or ``one_by_one``; the raw JSON answers."""
    sampling = {"max_new_tokens": 6, "ignore_eos": True}
    bodies = [
        {
            "input_ids": [5, 6, 7 + i % 3],
            "sampling_params": dict(sampling, sampling_seed=i),
            "return_logprob": True,
            "rid": f"{tag}-{i}",
        }
        for i in range(n)
    ]

    async def go() -> list[dict[str, Any]]:
        async with EngineClient(url, timeout_s=60) as c:
            if one_by_one:
                return [await c.request("POST", "/generate", b) for b in bodies]
            return list(await asyncio.gather(*[c.request("POST", "/generate", b) for b in bodies]))

    return asyncio.run(go())


def test_generation_reaches_both_engines_with_their_fields_intact(
    engines: list[str], router: SglangRouter
) -> None:
    url = router.start(engines)
    assert router.alive()
    assert sorted(w["url"] for w in router.workers()) == sorted(engines)
    # Concurrent requests are spread over both engines.
    spread = generate(url, 8, "spread")
    assert {r["meta_info"]["weight_version"] for r in spread} == set(VERSIONS)
    # One at a time (no batching, so the engine's arithmetic is the same each time), the
    # answer through the router is the engine's own: same fields, tokens, log-probs, finish
    # reason, and the weight version of whichever engine served it.
    routed = generate(url, 4, "routed", one_by_one=True)
    direct = generate(engines[0], 4, "direct", one_by_one=True)
    assert {r["meta_info"]["weight_version"] for r in routed} == set(VERSIONS)
    for i, (via, ref) in enumerate(zip(routed, direct, strict=True)):
        assert via.keys() == ref.keys() and via["meta_info"].keys() == ref["meta_info"].keys()
        assert via["meta_info"]["id"] == f"routed-{i}"
        for key in ("output_token_logprobs", "finish_reason", "prompt_tokens"):
            assert via["meta_info"][key] == ref["meta_info"][key], key
        assert via["output_ids"] == ref["output_ids"]
        parsed = GenerateResult.from_json(via)
        assert parsed.finish_reason == "length" and len(parsed.logprobs) == 6


def test_set_engines_sends_everything_to_the_remaining_engine(
    engines: list[str], router: SglangRouter
) -> None:
    url = router.start(engines)
    router.set_engines(engines[:1])
    assert [w["url"] for w in router.workers()] == engines[:1]
    assert {r["meta_info"]["weight_version"] for r in generate(url, 6, "one")} == {VERSIONS[0]}
    router.set_engines(engines[1:])
    assert {r["meta_info"]["weight_version"] for r in generate(url, 6, "other")} == {VERSIONS[1]}
    router.set_engines([])  # every engine is restarting: requests fail at once
    assert router.workers() == []
    with pytest.raises(EngineHTTPError) as err:
        generate(url, 1, "none")
    assert err.value.status == 503
    router.set_engines(engines)  # the engines come back
    assert {r["meta_info"]["weight_version"] for r in generate(url, 6, "both")} == set(VERSIONS)
    assert router.engines == engines


def test_killed_router_is_not_alive(engines: list[str], router: SglangRouter) -> None:
    router.start(engines)
    assert router.alive()
    proc = router.process
    assert proc is not None and os.getpgid(proc.pid) == proc.pid  # a session of its own
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while router.alive():
        assert time.monotonic() < deadline, "a killed router still reads alive"
        time.sleep(0.05)
    with pytest.raises(RouterError, match="exited with -9"):
        router.set_engines(engines)
    router.stop()
    router.stop()
    # A stopped router can be started again, on the same engines.
    router.start(engines)
    assert router.alive()


def test_log_file_holds_the_router_output(
    engines: list[str], router: SglangRouter, tmp_path: Path
) -> None:
    router.options = SglangRouterOptions(log_dir=str(tmp_path / "logs"), log_level="info")
    router.start(engines)
    assert router.log_path is not None and Path(router.log_path).parent == tmp_path / "logs"
    assert "Starting router" in Path(router.log_path).read_text()
    tail = router.log_tail(n=100_000)
    assert "Starting router" in tail and "\x1b[" not in tail  # without terminal colours


def test_engine_answers_what_the_router_asks(engines: list[str]) -> None:
    async def go() -> dict[str, Any]:
        async with EngineClient(engines[0]) as c:
            out: dict[str, Any] = {
                path: await c.request("GET", path)
                for path in ("/model_info", "/get_model_info", "/server_info")
            }
            # The body as sglang-router 0.3.2 rewrites it.
            out["generate"] = await c.request(
                "POST",
                "/generate",
                {
                    "model": None, "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2},
                    "return_logprob": True, "return_text_in_logprobs": False, "stream": False,
                    "log_metrics": True, "return_hidden_states": False, "background": False,
                    "no_logs": False, "return_bytes": False, "return_entropy": False, "rid": "rw",
                },
            )  # fmt: skip
            with pytest.raises(EngineHTTPError, match="return_hidden_states") as err:
                await c.request(
                    "POST", "/generate", {"input_ids": [5], "return_hidden_states": True}
                )
            out["refused"] = err.value.status
            return out

    out = asyncio.run(go())
    assert out["/model_info"] == out["/get_model_info"]
    assert out["/server_info"]["internal_states"][0]["running_requests"] == 0
    assert out["generate"]["meta_info"]["id"] == "rw" and len(out["generate"]["output_ids"]) == 2
    assert out["refused"] == 400
