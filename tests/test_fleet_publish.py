"""The fleet's weight publication when an engine is lost while an update is failing."""

from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from typing import Any

from core_support import IdleEngineClient

from miles_core.runtime.fleet import EngineFleet


class FakeClient(IdleEngineClient):
    pass


class FakeLauncher:
    num_engines = 2

    def __init__(self) -> None:
        self.launches = 0

    def launch(self, model_path: str, index: int) -> str:
        self.launches += 1
        return f"http://engine-{index}-{self.launches}"

    def client(self, url: str) -> FakeClient:
        return FakeClient(url)

    def stop(self, index: int) -> None:
        pass


class RestartDuringSend:
    """The first send fails, after the rollout side (another task of the loop) found engine 1
    dead and restarted it: by the time the update reports its failure, engine 1 answers
    again. Later sends succeed."""

    def __init__(self) -> None:
        self.fleet: EngineFleet | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sends: list[list[str]] = []

    def send(self, weights: Any, *, version: int, engines: list[str]) -> dict[str, float]:
        self.sends.append(list(engines))
        if len(self.sends) == 1:
            fleet, loop = self.fleet, self.loop
            assert fleet is not None and loop is not None
            loop.call_soon_threadsafe(fleet.begin_restart, fleet.engines[1])
            deadline = time.monotonic() + 10
            while not fleet.engines[1].restarted:  # the restart finished: it answers again
                assert time.monotonic() < deadline
                time.sleep(0.01)
            raise RuntimeError("gloo: timed out waiting for send operation to complete")
        return {"bytes": 1.0}


def test_an_engine_restarted_while_an_update_fails_gets_the_retry() -> None:
    transport = RestartDuringSend()
    fleet = EngineFleet(
        FakeLauncher(),  # type: ignore[arg-type]
        transport,  # type: ignore[arg-type]
        model_path="m",
        weights=lambda: nullcontext([]),
        log=lambda line: None,
    )
    transport.fleet = fleet

    async def go() -> dict[str, float]:
        transport.loop = asyncio.get_running_loop()
        await fleet.start(0)
        return await fleet.publish(1, pause="retract")

    metrics = asyncio.run(go())
    assert "time/sync_s" in metrics
    assert len(transport.sends) == 2
    # the retry went to both: the serving engine and the restarted one (its new server)
    assert transport.sends[1] == ["http://engine-0-1", "http://engine-1-3"]
    assert [e.version for e in fleet.engines] == [1, 1]
    assert not any(e.down for e in fleet.engines)


class Unreachable(FakeClient):
    """An engine that started on its node, at an address this process cannot reach."""

    async def health(self) -> bool:
        return False


class UnreachableLauncher(FakeLauncher):
    num_engines = 1

    def launch(self, model_path: str, index: int) -> str:
        return "http://127.0.0.5:9"

    def client(self, url: str) -> FakeClient:
        return Unreachable(url)


def test_an_engine_the_driver_cannot_reach_is_a_clear_error() -> None:
    import pytest

    from miles_core.errors import MilesUserError

    fleet = EngineFleet(
        UnreachableLauncher(),  # type: ignore[arg-type]
        RestartDuringSend(),  # type: ignore[arg-type]
        model_path="m",
        weights=lambda: nullcontext([]),
        log=lambda line: None,
    )
    with pytest.raises(MilesUserError) as err:
        asyncio.run(fleet.start(0))
    text = str(err.value)
    assert "engine 0 started, but this process cannot reach it at http://127.0.0.5:9" in text
    assert "--node-ip-address" in text
