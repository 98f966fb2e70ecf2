"""Every request the engine client sends is one SGLang 0.5.23 accepts: a native route with
that method, and a body whose keys are fields of the request struct SGLang parses it into,
with values of the types written there (SGLang ignores an unknown key: a misspelt field
would silently do nothing).

The bodies are captured from a real :class:`EngineClient` talking to a small aiohttp server
that records what arrives. The paths the client can call are read from its source (every
``self.request(METHOD, PATH, ...)``), not listed by hand. ``/generate`` bodies also go
through SGLang's own generated HTTP contract decoder when sglang is installed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from miles_engine_client import EngineClient, EngineHTTPError, GenerateResult
from miles_engine_client.client import PAUSE_MODES

sys.path.insert(0, str(Path(__file__).parent))
import sglang_api_reference as ref

REFERENCE = ref.load_reference()
ROUTES: dict[str, dict[str, Any]] = REFERENCE["routes"]["items"]
REQUEST_TYPES: dict[str, dict[str, Any]] = REFERENCE["request_types"]["items"]
CONTRACT = REFERENCE["contract"]

Call = Callable[[EngineClient], Awaitable[Any]]

#: One call per public method of the client, with every optional argument set, so each
#: field the method can send is sent. ``test_every_client_method_is_called`` keeps this
#: complete: a new method fails until it is added here.
CALLS: dict[str, list[Call]] = {
    "generate": [
        lambda c: c.generate([1, 2, 3]),
        lambda c: c.generate(
            [1, 2, 3],
            {
                "max_new_tokens": 8,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "stop_token_ids": [2],
                "ignore_eos": False,
                "sampling_seed": 11,
                "n": 1,
            },
            return_logprob=False,
            rid="r-1",
            lora_path="policy",
        ),
    ],
    "input_logprobs": [lambda c: c.input_logprobs([1, 2, 3, 4], start=2)],
    "abort_request": [
        lambda c: c.abort_request("r-1"),
        lambda c: c.abort_request(abort_all=True),
    ],
    "pause_generation": [lambda c, m=m: c.pause_generation(m) for m in PAUSE_MODES],
    "continue_generation": [lambda c: c.continue_generation()],
    "flush_cache": [lambda c: c.flush_cache()],
    "update_weights_from_disk": [
        lambda c: c.update_weights_from_disk("/ckpt/step-1"),
        lambda c: c.update_weights_from_disk(
            "/ckpt/step-2", weight_version="2", abort_all_requests=True, flush_cache=False
        ),
    ],
    "init_weights_update_group": [
        lambda c: c.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=29500,
            rank_offset=1,
            world_size=2,
            group_name="g",
            backend="gloo",
        ),
    ],
    "update_weights_from_distributed": [
        lambda c: c.update_weights_from_distributed(
            ["w"], ["float32"], [[2, 3]], group_name="g", weight_version="3", flush_cache=False
        ),
    ],
    "update_weights_from_tensor": [
        lambda c: c.update_weights_from_tensor(
            ["QUJDRA=="], load_format="direct", weight_version="4", flush_cache=False
        ),
    ],
    "load_lora_adapter": [
        lambda c: c.load_lora_adapter("policy", "/ckpt/adapter"),
        lambda c: c.load_lora_adapter("pinned", "/ckpt/adapter", pinned=True),
    ],
    "unload_lora_adapter": [lambda c: c.unload_lora_adapter("policy")],
    "load_lora_adapter_from_tensors": [
        lambda c: c.load_lora_adapter_from_tensors(
            "policy", [("base_model.model.x.lora_A.weight", [0.0])], {"r": 1}, pinned=True
        ),
        lambda c: c.load_lora_adapter_from_tensors(
            "policy",
            {"flattened_tensor": [], "metadata": []},
            {"r": 1},
            load_format="flattened_bucket",
        ),
    ],
    "get_weight_version": [lambda c: c.get_weight_version()],
    "update_weight_version": [
        lambda c: c.update_weight_version("6"),
        lambda c: c.update_weight_version("7", abort_all_requests=False),
    ],
    "release_memory_occupation": [
        lambda c: c.release_memory_occupation(),
        lambda c: c.release_memory_occupation(["kv_cache", "weights"]),
    ],
    "resume_memory_occupation": [
        lambda c: c.resume_memory_occupation(),
        lambda c: c.resume_memory_occupation(["weights"]),
    ],
    "health": [lambda c: c.health()],
    "health_generate": [lambda c: c.health_generate()],
    "get_model_info": [lambda c: c.get_model_info()],
    "get_server_info": [lambda c: c.get_server_info()],
}


def _sglang_input_logprobs(body: dict[str, Any]) -> list[list[Any]]:
    """``input_token_logprobs`` as SGLang 0.5.23 builds them (``logprob_result_processor``:
    ``[None] + logprobs[:-1]`` over ``input_ids[logprob_start_len:]``): a null at
    ``logprob_start_len`` itself, whatever it is; here the token at position ``p`` gets
    ``-p / 10``."""
    start, ids = body.get("logprob_start_len", -1), body["input_ids"]
    if not body.get("return_logprob") or start < 0:
        return []
    return [[None if p == start else -p / 10, ids[p], None] for p in range(start, len(ids))]


def _answer(path: str, state: dict[str, Any], body: Any) -> web.Response:
    """What SGLang answers on ``path`` (shapes of its http_server.py handlers)."""
    if path == "/generate":
        if body["sampling_params"].get("max_new_tokens") == 0:
            return web.json_response(
                {"text": "", "output_ids": [], "meta_info": {
                    "id": "r", "finish_reason": {"type": "length", "length": 0},
                    "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0,
                    "weight_version": state["version"], "output_token_logprobs": [],
                    "input_token_logprobs": _sglang_input_logprobs(body)}}
            )  # fmt: skip
        return web.json_response(
            {"text": "", "output_ids": [5, 2], "meta_info": {
                "id": "r", "finish_reason": {"type": "stop", "matched": 2},
                "prompt_tokens": 3, "completion_tokens": 2,
                "weight_version": state["version"],
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]]}}
        )  # fmt: skip
    if path in ("/model_info", "/get_model_info"):
        return web.json_response(
            {"model_path": "/m", "is_generation": True, "weight_version": state["version"]}
        )
    if path in ("/server_info", "/get_server_info"):
        return web.json_response({"max_running_requests": 8, "internal_states": [{}]})
    if path in ("/flush_cache", "/health", "/health_generate", "/abort_request"):
        return web.Response(text="")
    return web.json_response({"success": True, "message": "ok"})


class CaptureServer:
    """An aiohttp server on its own thread and event loop that records every request
    (method, path, JSON body) and answers like SGLang; ``state["version"]`` is the weight
    version it reports."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {"version": "0"}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.runner, self.url = started.result(30)

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw.strip() else None
        self.seen.append({"method": request.method, "path": request.path, "body": body})
        return _answer(request.path, self.state, body)

    async def _start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return runner, f"http://127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def capture() -> Iterator[CaptureServer]:
    """A fresh :class:`CaptureServer`."""
    server = CaptureServer()
    try:
        yield server
    finally:
        server.close()


def client_endpoint_methods() -> set[str]:
    """Public coroutine methods of :class:`EngineClient` that call an endpoint."""
    return ref.client_endpoint_methods(EngineClient)


def client_paths() -> dict[str, set[tuple[str, str]]]:
    """Method name -> the (HTTP method, path) pairs its source sends (read from it)."""
    return ref.client_paths(EngineClient)


def captured(server: CaptureServer) -> dict[str, list[dict[str, Any]]]:
    """Client method -> the requests its calls in ``CALLS`` sent to ``server``."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(client_endpoint_methods()):
        calls, start = CALLS[name], len(server.seen)

        async def one(calls: list[Call] = calls) -> None:
            async with EngineClient(server.url, connect_retries=0) as c:
                for call in calls:
                    await call(c)

        asyncio.run(one())
        by_method[name] = server.seen[start:]
    return by_method


def test_every_client_method_is_called() -> None:
    missing = client_endpoint_methods() - set(CALLS)
    assert not missing, f"add calls of {sorted(missing)} to CALLS"


def test_every_path_the_client_can_call_is_a_native_sglang_route() -> None:
    paths = client_paths()
    assert all(paths.values()), {n: p for n, p in paths.items() if not p}
    problems = []
    for name, pairs in sorted(paths.items()):
        for method, path in sorted(pairs):
            route = ROUTES.get(path)
            if route is None:
                problems.append(f"EngineClient.{name}: {method} {path} is not an SGLang route")
            elif method not in route["methods"]:
                problems.append(
                    f"EngineClient.{name}: {path} takes {route['methods']}, not {method}"
                )
    where = f"SGLang {REFERENCE['sglang_version']} ({ref.HTTP_SERVER})"
    assert not problems, where + ":\n" + "\n".join(problems)


def test_the_captured_requests_are_those_the_source_names(capture: CaptureServer) -> None:
    paths = client_paths()
    for name, requests in captured(capture).items():
        assert {(r["method"], r["path"]) for r in requests} == paths[name], name


def test_every_request_body_fits_sglangs_request_struct(capture: CaptureServer) -> None:
    problems = []
    for name, requests in sorted(captured(capture).items()):
        for r in requests:
            route = ROUTES.get(r["path"])
            if route is None:
                problems.append(f"{name}: {r['path']} is not an SGLang route")
                continue
            body = r["body"]
            if route["body"] is None:
                if body not in (None, {}):
                    problems.append(f"{name}: {r['path']} reads no body, got {body}")
                continue
            struct = REQUEST_TYPES[route["body"]]
            for p in ref.check_object(body or {}, struct["fields"], unknown_keys="ignored"):
                problems.append(f"{name}: {r['path']} -> {route['body']}: {p}")
    assert not problems, "\n".join(problems)


def test_generate_bodies_fit_sglangs_http_contract(capture: CaptureServer) -> None:
    requests = captured(capture)
    bodies = [r["body"] for name in ("generate", "input_logprobs") for r in requests[name]]
    types = CONTRACT["types"]
    for body in bodies:
        problems = ref.check_object(
            body, types["GenerateRequest"]["fields"], CONTRACT["aliases"], types,
            unknown_keys="ignored",
        )  # fmt: skip
        assert not problems, problems
    if ref.installed_version() is not None:
        # SGLang's own generated decoder, the one its /generate route runs first.
        api = ref.load_api_types(ref.installed_root())
        for body in bodies:
            api.GenerateRequest.from_json_value(body)
            api.SamplingParams.from_json_value(body.get("sampling_params") or {})


def test_pause_modes_are_sglangs() -> None:
    mode = REQUEST_TYPES["PauseGenerationReqInput"]["fields"]["mode"]["type"]
    for m in PAUSE_MODES:
        assert ref.check_value(m, mode) is None, (m, mode)
    assert ref.check_value("pause", mode) is not None


def test_a_mode_sglang_lacks_is_refused_before_sending(capture: CaptureServer) -> None:
    async def go() -> None:
        async with EngineClient(capture.url) as c:
            with pytest.raises(ValueError, match="not one of SGLang's modes"):
                await c.pause_generation("drain")

    asyncio.run(go())
    assert capture.seen == []


@pytest.mark.parametrize(
    ("reported", "expected"), [("12", "12"), (None, None), (3, "3"), ("step-4", "step-4")]
)
def test_weight_version_as_reported(
    capture: CaptureServer, reported: Any, expected: str | None
) -> None:
    capture.state["version"] = reported

    async def go() -> tuple[Any, GenerateResult]:
        async with EngineClient(capture.url) as c:
            return await c.get_weight_version(), await c.generate([1])

    version, gen = asyncio.run(go())
    assert version == expected
    assert gen.weight_version == ("" if expected is None else expected)
    assert [r["path"] for r in capture.seen] == ["/model_info", "/generate"]


def test_input_logprobs_against_sglangs_answer(capture: CaptureServer) -> None:
    """SGLang 0.5.23 puts a null at ``logprob_start_len``: the client asks one position early
    and returns exactly the positions ``start..len-1``; a null among those, or too few
    entries, is an error; a ``start`` below 1 or past the input is refused unsent."""

    async def go() -> list[float]:
        async with EngineClient(capture.url) as c:
            for bad in (0, -1, 6):
                with pytest.raises(ValueError, match="start must be in"):
                    await c.input_logprobs([1, 2, 3, 4, 5], start=bad)
            return await c.input_logprobs([1, 2, 3, 4, 5], start=2)

    assert asyncio.run(go()) == [-0.2, -0.3, -0.4]
    body = capture.seen[-1]["body"]
    assert len(capture.seen) == 1 and body["logprob_start_len"] == 1, capture.seen
    assert body["sampling_params"] == {"max_new_tokens": 0} and body["return_logprob"] is True


@pytest.mark.parametrize(
    ("entries", "problem"),
    [([], "got 0 entries"), ([[None, 3, None], [None, 4, None]], "a null log-prob")],
)
def test_input_logprobs_refuses_a_short_or_null_answer(entries: list[Any], problem: str) -> None:
    async def answer(request: web.Request) -> web.Response:
        meta = {"finish_reason": {"type": "abort"}, "input_token_logprobs": entries}
        return web.json_response({"output_ids": [], "meta_info": meta})

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/generate", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with EngineClient(url) as c:
                with pytest.raises(EngineHTTPError, match=problem) as err:
                    await c.input_logprobs([1, 2, 3, 4], start=2)
            assert "abort" in str(err.value)
        finally:
            await runner.cleanup()

    asyncio.run(go())
