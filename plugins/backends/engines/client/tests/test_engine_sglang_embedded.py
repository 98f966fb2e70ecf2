"""The embedded engine serves SGLang 0.5.23's API as far as it goes, so one client runs
against both: it routes every path the client can call, each of its routes is an SGLang
route, each body it accepts is a subset of SGLang's request struct for that route, and its
answers decode with SGLang's response contract (``sglang/api/v1/api_types.py``)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from miles_engine_client import EngineClient

server_mod = pytest.importorskip("miles_engine_embedded.server")
protocol = pytest.importorskip("miles_engine_embedded.protocol")

sys.path.insert(0, str(Path(__file__).parent))
import sglang_api_reference as ref  # noqa: E402

REFERENCE = ref.load_reference()
ROUTES: dict[str, dict[str, Any]] = REFERENCE["routes"]["items"]
REQUEST_TYPES: dict[str, dict[str, Any]] = REFERENCE["request_types"]["items"]
CONTRACT = REFERENCE["contract"]
WHERE = f"SGLang {REFERENCE['sglang_version']}"


def _receiver_routes() -> dict[str, str]:
    """The receiver route of each installed transport declaring one -> its capability."""
    from miles_core import Kind, Transport
    from miles_core.plugins import load_plugins

    return {
        t.receiver_route: cap
        for t in load_plugins().registry.all(Kind.TRANSPORT)
        if isinstance(t, Transport) and t.receiver_route
        for cap in t.engine_capabilities
    }


#: Routes the embedded engine serves for a declared engine capability that SGLang has no
#: endpoint for (``p2p_weights``: the NIXL receiver the p2p transport writes into, mounted from
#: the transport's record; ``weights_from_peer``: an engine's copy of another's weights). The
#: SGLang engine does not declare them, so a run pairing SGLang with p2p is refused at
#: validation, and a joining SGLang engine waits for the next weight update.
EXTENSIONS = {
    **_receiver_routes(),
    server_mod.LORA_DISTRIBUTED_PATH: "lora_weight_updates",
    **{route.path: "weights_from_peer" for route in server_mod.PeerRoutes.ROUTES},
}


def embedded_routes() -> dict[str, tuple[str, str, type]]:
    """Path -> (HTTP method or ``*``, handler name, route group), read from the route tables
    of ``ROUTE_GROUPS``; the routes of :data:`EXTENSIONS` are left out."""
    out = {}
    for group in server_mod.ROUTE_GROUPS:
        for route in group.ROUTES:
            if route.path not in EXTENSIONS:
                out[route.path] = (route.method, route.handler, group)
    return out


def test_extensions_are_declared_capabilities() -> None:
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    record = load_plugins().registry.get(Kind.ROLLOUT_ENGINE, "embedded")
    assert "p2p_weights" in EXTENSIONS.values(), "the p2p transport declares no receiver route"
    assert set(EXTENSIONS.values()) <= record.capabilities  # type: ignore[attr-defined]
    assert not set(EXTENSIONS) & set(ROUTES), "an extension path is an SGLang route now"


def body_model(group: type, handler: str) -> type | None:
    """The protocol model a handler validates its body with (``parse_body(request, M)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(group, handler))))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "parse_body":
            return getattr(protocol, ast.unparse(node.args[1]))
    return None


def test_every_embedded_route_is_an_sglang_route() -> None:
    problems = []
    for path, (method, _, _) in sorted(embedded_routes().items()):
        route = ROUTES.get(path)
        if route is None:
            problems.append(f"{path} is not an SGLang route")
        elif method != "*" and method not in route["methods"]:
            problems.append(f"{path}: {WHERE} takes {route['methods']}, not {method}")
    assert not problems, f"{WHERE} ({ref.HTTP_SERVER}):\n" + "\n".join(problems)


def test_every_client_path_is_an_embedded_route() -> None:
    routes = embedded_routes()
    for name, pairs in ref.client_paths(EngineClient).items():
        for method, path in pairs:
            assert path in routes, f"EngineClient.{name} calls {path}, which is not served"
            assert routes[path][0] in ("*", method), (name, path, routes[path])


def test_embedded_bodies_are_within_sglangs_structs() -> None:
    problems = []
    for path, (_, handler, group) in sorted(embedded_routes().items()):
        model = body_model(group, handler)
        route = ROUTES.get(path)
        if model is None or route is None:
            continue  # no body, or a route the test above already reports
        if route["body"] is None:
            problems.append(f"{path}: {WHERE} reads no body but {model.__name__} is accepted")
            continue
        extra = set(model.model_fields) - set(REQUEST_TYPES[route["body"]]["fields"])
        if extra:
            problems.append(f"{path}: {model.__name__} accepts {sorted(extra)}, which "
                            f"{route['body']} lacks")  # fmt: skip
    sampling = set(CONTRACT["types"]["SamplingParams"]["fields"])
    extra = set(protocol.SamplingParams.model_fields) - sampling
    if extra:
        problems.append(f"sampling_params: {sorted(extra)} are not SGLang sampling params")
    assert not problems, "\n".join(problems)


def test_live_engine_routes_every_client_path(engine_url: str) -> None:
    """Each client path answers something other than 404 / 405. POST bodies carry an unknown
    field, which the embedded engine refuses with 400 before acting on anything."""

    async def go() -> dict[tuple[str, str], int]:
        status = {}
        async with aiohttp.ClientSession() as s:
            for pairs in ref.client_paths(EngineClient).values():
                for method, path in pairs:
                    body = {"not_a_field": 1} if method == "POST" else None
                    async with s.request(method, engine_url + path, json=body) as r:
                        status[(method, path)] = r.status
        return status

    status = asyncio.run(go())
    unrouted = {k: v for k, v in status.items() if v in (404, 405)}
    assert not unrouted, unrouted


def test_live_answers_fit_sglangs_response_contract(engine_url: str) -> None:
    async def go() -> dict[str, Any]:
        async with EngineClient(engine_url) as c:
            gen = await c.generate([3, 4], {"max_new_tokens": 2}, rid="contract")
            return {
                "generate": gen.raw,
                "model_info": await c.get_model_info(),
                "server_info": await c.get_server_info(),
                "version": await c.get_weight_version(),
            }

    out = asyncio.run(go())
    types, aliases = CONTRACT["types"], CONTRACT["aliases"]
    for key, struct in (("model_info", "GetModelInfoResponse"),
                        ("server_info", "GetServerInfoResponse")):  # fmt: skip
        problems = ref.check_object(out[key], types[struct]["fields"], aliases, types)
        assert not [p for p in problems if "is not a field" not in p], (key, problems)
    assert out["version"] == out["model_info"]["weight_version"]
    assert out["version"] == out["generate"]["meta_info"]["weight_version"]
    assert isinstance(out["server_info"]["max_running_requests"], int)
    if ref.installed_version() is not None:
        api = ref.load_api_types(ref.installed_root())
        api.GenerateResponse.from_json_value(out["generate"])
        api.GetModelInfoResponse.from_json_value(out["model_info"])
        api.GetServerInfoResponse.from_json_value(out["server_info"])
