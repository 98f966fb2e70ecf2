"""The receiver routes: mounted from the transport records that declare one (no transport is
named by the server), each building its record's receiver once per sender and committing the
update it receives into the served model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass
class FolderReceiver:
    """A receiver whose sender is a checkpoint folder: ``receive`` hands the folder's tensors
    to the engine's target and returns the version the address names."""

    folder: str
    version: int
    closed: bool = False

    def receive(self, target: Any) -> int:
        from safetensors.torch import load_file

        target(sorted(load_file(str(Path(self.folder) / "model.safetensors")).items()))
        return self.version

    def close(self) -> None:
        self.closed = True


BUILT: list[FolderReceiver] = []


def build_folder_receiver(options: Any, address: tuple[Any, ...], rank: int) -> FolderReceiver:
    """The record's ``receiver_factory``: ``address`` is ``(folder, version)``."""
    assert options is None and rank == 1
    receiver = FolderReceiver(str(address[0]), int(address[1]))
    BUILT.append(receiver)
    return receiver


def test_installed_transports_declare_their_receiver_routes() -> None:
    pytest.importorskip("miles_transport_p2p")
    from miles_engine_embedded.receiver_routes import receiver_records

    routes = {r.name: r.receiver_route for r in receiver_records()}
    assert routes.get("p2p") == "/miles/p2p_weights"
    assert "broadcast" not in routes and "colocated" not in routes  # SGLang's endpoints


def test_a_declared_receiver_route_is_mounted_and_commits_updates(
    tiny_model: Path, tiny_model_v2: Path
) -> None:
    import torch
    from aiohttp.test_utils import TestClient, TestServer
    from miles_engine_embedded.engine import Engine
    from miles_engine_embedded.receiver_routes import receiver_routes
    from miles_engine_embedded.routing import WEIGHTS_BODY_LIMIT, build_app
    from miles_engine_embedded.weight_routes import WeightRoutes
    from miles_engine_embedded.weights import ModelHolder
    from safetensors.torch import load_file

    from miles_core import Transport

    declared = Transport(
        name="folder",
        factory=build_folder_receiver,
        receiver_factory=build_folder_receiver,
        receiver_route="/test/folder_weights",
    )
    undeclared = Transport(name="plain", factory=build_folder_receiver)
    holder = ModelHolder(str(tiny_model), device="cpu", dtype="float32", weight_version="0")
    engine = Engine(
        holder, max_running_requests=2, max_total_tokens=400, context_length=200, seed=0
    )
    engine.start()
    weights = WeightRoutes(engine, server_args={})
    groups = receiver_routes(weights, [undeclared, declared])
    assert [g.record.name for g in groups] == ["folder"]

    async def nothing(_app: Any) -> None:
        return None

    async def go() -> list[tuple[int, dict[str, Any]]]:
        app = build_app(groups, weights_limit=WEIGHTS_BODY_LIMIT, on_shutdown=nothing)
        answers = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for address in ([str(tiny_model_v2), 7], [str(tiny_model_v2), 7], [str(tiny_model), 8]):
                body = {"address": address, "version": address[1]}
                resp = await client.post("/test/folder_weights", json=body)
                answers.append((resp.status, await resp.json()))
            resp = await client.post("/miles/p2p_weights", json={"address": [], "version": 1})
            answers.append((resp.status, {}))  # not declared by a record given: not served
        return answers

    BUILT.clear()
    try:
        answers = asyncio.run(go())
    finally:
        engine.stop()
    assert [(s, a.get("weight_version")) for s, a in answers[:3]] == [
        (200, "7"),
        (200, "7"),
        (200, "8"),
    ]
    assert answers[3][0] == 404
    # one receiver per sender: the second update reused the first; a new sender closed it
    assert [r.version for r in BUILT] == [7, 8] and BUILT[0].closed and not BUILT[1].closed
    assert holder.weight_version == "8"
    served = load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.equal(holder.params[n], t) for n, t in served.items())
