"""EngineSupervisor against a real embedded engine server process: kill -9 during generation
and SIGSTOP (hung) are detected, the engine is restarted, given the current weights, and the
request that was in flight fails fast with a clear error."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles_engine_client import EngineClient
from miles_engine_client.router import EngineRouter, EngineUnavailable
from miles_engine_client.supervisor import EngineSupervisor

sys.path.insert(0, str(Path(__file__).parent))
from engine_fixtures import EngineCluster, make_tiny_model, wait_until

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]
# Fast checks so a test detects a hang in about two seconds.
FAST: dict[str, Any] = {
    "interval_s": 0.3,
    "health_timeout_s": 1.0,
    "failures_to_dead": 2,
    "launch_timeout_s": 120,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture: the initial weights and the ones of version 1."""
    v0 = make_tiny_model(tmp_path_factory.mktemp("sup-v0"), seed=0)
    v1 = make_tiny_model(tmp_path_factory.mktemp("sup-v1"), seed=1)
    return v0, v1


@pytest.fixture(scope="module")
def cluster(models: tuple[Path, Path]) -> Iterator[EngineCluster]:
    """One engine (slot 0); the tests below restart it in turn."""
    c = EngineCluster(models[0])
    try:
        c.start(1)
        yield c
    finally:
        c.shutdown()


@pytest.mark.slow
def test_kill_9_restarts_and_resyncs_weights(
    cluster: EngineCluster, models: tuple[Path, Path]
) -> None:
    current: dict[str, str | None] = {"path": None, "version": None}

    async def resync(client: EngineClient) -> None:
        if current["path"] is not None:
            await client.update_weights_from_disk(
                current["path"], weight_version=current["version"]
            )

    async def go() -> None:
        router = EngineRouter([EngineClient(cluster.launcher.urls[0])], engine_wait_s=60)
        sup = EngineSupervisor(
            router,
            cluster.launch,
            resync=resync,
            current_version=lambda: current["version"],
            process=cluster.process,
            **FAST,
        )
        async with sup:
            r0 = await router.generate(PROMPT, GREEDY)
            # The loop pushes version "1" and records it for resync.
            await router.update_weights_from_disk(str(models[1]), weight_version="1")
            current.update(path=str(models[1]), version="1")
            r1 = await router.generate(PROMPT, GREEDY)
            assert (r0.weight_version, r1.weight_version) == ("0", "1")
            assert r1.output_ids != r0.output_ids  # the new weights are really in use

            old_url, old_pid = router.client(0).base_url, cluster.pid(0)
            await router.client(0).pause_generation("in_place")  # keep it mid-generation
            victim = asyncio.create_task(router.generate(PROMPT, GREEDY, rid="victim"))
            await wait_until(lambda: router.in_flight() == {0: 1})
            t0 = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(EngineUnavailable) as err:
                await asyncio.wait_for(victim, timeout=10)
            assert time.monotonic() - t0 < 3.0, "the in-flight request did not fail fast"
            assert err.value.url == old_url and old_url in str(err.value)

            await sup.wait_for_restarts(1, timeout_s=90)
            assert cluster.pid(0) != old_pid
            assert await router.client(0).get_weight_version() == "1"
            r2 = await asyncio.wait_for(router.generate(PROMPT, GREEDY), timeout=30)
            assert r2.weight_version == "1" and r2.output_ids == r1.output_ids
            assert sup.metrics()["supervisor/restarts_total"] == 1.0
            assert sup.metrics()["supervisor/engine/0/restarts"] == 1.0
            assert "exited" in str(sup.status(0)["last_error"])
            m = router.metrics()
            assert m["engine/0/failures_total"] == 1.0 and m["engine/0/requests_total"] == 4.0
        await router.close()

    asyncio.run(go())


@pytest.mark.slow
def test_hung_engine_detected_by_health_timeout(cluster: EngineCluster) -> None:
    async def go() -> None:
        router = EngineRouter([EngineClient(cluster.launcher.urls[0])], engine_wait_s=60)
        sup = EngineSupervisor(router, cluster.launch, process=cluster.process, **FAST)
        async with sup:
            assert (await router.generate(PROMPT, GREEDY)).finish_reason == "length"
            old_proc = cluster.process(0)
            assert old_proc is not None
            await router.client(0).pause_generation("in_place")
            victim = asyncio.create_task(router.generate(PROMPT, GREEDY, rid="hung"))
            await wait_until(lambda: router.in_flight() == {0: 1})
            t0 = time.monotonic()
            os.kill(old_proc.pid, signal.SIGSTOP)
            # The process lives on; only /health timing out can reveal the hang.
            with pytest.raises(EngineUnavailable, match="no answer within") as err:
                await asyncio.wait_for(victim, timeout=20)
            detected = time.monotonic() - t0
            assert detected < 10.0
            assert err.value.index == 0
            await sup.wait_for_restarts(1, timeout_s=90)
            # The stopped process was killed, not left behind.
            assert old_proc.poll() == -signal.SIGKILL
            assert cluster.pid(0) != old_proc.pid
            r = await asyncio.wait_for(router.generate(PROMPT, GREEDY), timeout=30)
            assert r.finish_reason == "length"
            assert sup.restarts_total == 1
        await router.close()

    asyncio.run(go())


def test_restart_that_keeps_failing_gives_up(cluster: EngineCluster) -> None:
    """A launch that always fails is retried, then the slot is left out with the error."""

    def bad_launch(index: int) -> str:
        raise RuntimeError(f"cannot start engine {index}")

    async def go() -> None:
        router = EngineRouter([EngineClient(cluster.launcher.urls[0])], engine_wait_s=0.5)
        sup = EngineSupervisor(
            router, bad_launch, max_restart_attempts=2, restart_backoff_s=0.05, **FAST
        )
        from miles_engine_client.supervisor import EngineRestartError

        with pytest.raises(EngineRestartError, match="cannot start engine 0"):
            await asyncio.wait_for(sup.restart(0, "test"), timeout=10)
        assert sup.status(0)["gave_up"] is True and router.indices == []
        assert sup.metrics()["supervisor/restart_failures_total"] == 2.0
        assert sup.metrics()["supervisor/engines_down"] == 1.0
        await router.close()

    asyncio.run(go())
