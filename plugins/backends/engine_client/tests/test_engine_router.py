"""EngineRouter against two real embedded engine servers: least-busy routing, correct
results, broadcasts, metrics, and requests failing fast when their engine is taken out."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_engine_client import EngineClient
from miles_engine_client.router import EngineRouter, EngineUnavailable, NoEngineAvailable

sys.path.insert(0, str(Path(__file__).parent))
from engine_fixtures import EngineCluster, make_tiny_model, wait_until

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two embedded servers over the same tiny checkpoint."""
    cluster = EngineCluster(make_tiny_model(tmp_path_factory.mktemp("router-tiny"), seed=0))
    try:
        yield cluster.start(2)
    finally:
        cluster.shutdown()


async def _queued(client: EngineClient) -> int:
    """Requests the server itself holds (running + waiting), from ``/get_server_info``."""
    state = (await client.get_server_info())["internal_states"][0]
    return int(state["running_requests"]) + int(state["waiting_requests"])


def test_no_engine_fails_after_the_wait() -> None:
    async def go() -> float:
        router = EngineRouter(engine_wait_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(NoEngineAvailable, match="no engine in the router"):
            await router.generate([1, 2], {"max_new_tokens": 1})
        return time.monotonic() - t0

    assert asyncio.run(go()) < 2.0


@pytest.mark.slow
def test_slots_and_membership(two_engines: list[str]) -> None:
    async def go() -> None:
        a, b = EngineClient(two_engines[0]), EngineClient(two_engines[1])
        async with EngineRouter([a]) as router:
            assert router.add(b) == 1
            with pytest.raises(ValueError, match="slot 1 is taken"):
                router.add(a, index=1)
            assert router.remove(0) is a and router.indices == [1]
            assert router.remove(0) is None
            # A removed slot is not handed out again implicitly.
            assert router.add(a) == 2
            assert router.replace(2, EngineClient(two_engines[0])) is a
            await a.close()
            assert set(router.clients()) == {1, 2}

    asyncio.run(go())


@pytest.mark.slow
def test_router_spreads_by_load_and_results_match(two_engines: list[str]) -> None:
    async def go() -> None:
        direct = EngineClient(two_engines[0])
        expected = [(await direct.generate(p, GREEDY)).output_ids for p in PROMPTS]
        await direct.close()

        router = EngineRouter([EngineClient(u) for u in two_engines])
        c0, c1 = router.client(0), router.client(1)
        # Both engines hold what they get: requests stay in flight until released.
        await router.pause_generation("in_place")
        t_a = asyncio.create_task(router.generate(PROMPTS[0], GREEDY, rid="a"))
        await wait_until(lambda: router.in_flight() == {0: 1, 1: 0})
        t_b = asyncio.create_task(router.generate(PROMPTS[1], GREEDY, rid="b"))
        await wait_until(lambda: router.in_flight() == {0: 1, 1: 1})
        t_c = asyncio.create_task(router.generate(PROMPTS[2], GREEDY, rid="c"))
        await wait_until(lambda: router.in_flight() == {0: 2, 1: 1})
        # The servers agree: engine 0 holds two requests, engine 1 one.
        for _ in range(100):
            if (await _queued(c0), await _queued(c1)) == (2, 1):
                break
            await asyncio.sleep(0.02)
        assert (await _queued(c0), await _queued(c1)) == (2, 1)

        # Release engine 0 only; engine 1 still holds "b".
        await c0.continue_generation()
        ra, rc = await asyncio.wait_for(asyncio.gather(t_a, t_c), timeout=30)
        assert router.in_flight() == {0: 0, 1: 1}
        # Round-robin alone would pick engine 1 now; the least busy is engine 0.
        rd = await asyncio.wait_for(router.generate(PROMPTS[3], GREEDY, rid="d"), timeout=30)
        assert router.requests_total() == {0: 3, 1: 1}
        assert not t_b.done()

        await router.continue_generation()
        rb = await asyncio.wait_for(t_b, timeout=30)
        # Equal load again: the two next requests go one to each engine.
        re_, rf = await asyncio.gather(
            router.generate(PROMPTS[4], GREEDY), router.generate(PROMPTS[0], GREEDY)
        )
        assert router.requests_total() == {0: 4, 1: 2}

        got = [ra.output_ids, rb.output_ids, rc.output_ids, rd.output_ids, re_.output_ids]
        assert got == expected
        assert rf.output_ids == expected[0]
        assert [r.rid for r in (ra, rb, rc, rd)] == ["a", "b", "c", "d"]
        assert all(r.finish_reason == "length" and len(r.logprobs) == 12 for r in (ra, rb, rd))

        m = router.metrics()
        assert m["router/engines"] == 2.0 and m["router/in_flight"] == 0.0
        assert m["engine/0/requests_total"] == 4.0 and m["engine/1/requests_total"] == 2.0
        assert m["engine/0/failures_total"] == 0.0
        assert await router.get_weight_version() == {0: "0", 1: "0"}
        assert await router.flush_cache() is True
        assert await router.health() == {0: True, 1: True}
        await router.close()

    asyncio.run(go())


@pytest.mark.slow
def test_removed_engine_fails_in_flight_requests_fast(two_engines: list[str]) -> None:
    async def go() -> None:
        router = EngineRouter([EngineClient(u) for u in two_engines])
        await router.client(1).pause_generation("in_place")
        # Engine 0 busy with one, so the held request lands on engine 1.
        await router.client(0).pause_generation("in_place")
        first = asyncio.create_task(router.generate([3, 4], GREEDY, rid="x0"))
        await wait_until(lambda: router.in_flight() == {0: 1, 1: 0})
        held = asyncio.create_task(router.generate([3, 4], GREEDY, rid="x1"))
        await wait_until(lambda: router.in_flight() == {0: 1, 1: 1})
        t0 = time.monotonic()
        old = router.remove(1, "taken out by the test")
        with pytest.raises(EngineUnavailable) as err:
            await asyncio.wait_for(held, timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert err.value.url == two_engines[1] and err.value.index == 1
        assert two_engines[1] in str(err.value) and "taken out by the test" in str(err.value)
        # Abort by rid goes to the engine that runs it.
        await router.abort_request("x0")
        assert (await asyncio.wait_for(first, timeout=10)).finish_reason == "abort"
        assert router.metrics()["engine/1/failures_total"] == 1.0
        assert old is not None
        await old.abort_request(abort_all=True)
        await old.continue_generation()
        await old.close()
        await router.continue_generation()
        await router.close()

    asyncio.run(go())
