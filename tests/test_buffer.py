"""The bounded buffer: back-pressure, drop reasons, the staleness bound, the ledger."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.buffer import GroupBuffer
from miles_core.data import Group, Sample
from miles_core.ledger import DropReason, Ledger


def _group(ledger: Ledger, versions: list[int], rewards=(0.0, 1.0), finish="stop") -> Group:
    samples = []
    for i, r in enumerate(rewards):
        s = Sample(prompt_ids=[1], finish_reason=finish if i == 0 else "stop")
        for v in versions:
            s.append([5], logprobs=[-0.1], version=v)
        s.reward = r
        samples.append(s)
    g = Group(samples=samples, prompt={"prompt": f"p{versions}"})
    ledger.start(g.group_id)
    return g


def test_full_buffer_blocks_the_producer_never_drops():
    async def main():
        ledger = Ledger()
        buf = GroupBuffer(capacity=2, max_staleness=5, ledger=ledger)
        for _ in range(2):
            await buf.put(_group(ledger, [0]))
        third = asyncio.create_task(buf.put(_group(ledger, [0])))
        await asyncio.sleep(0.05)
        assert not third.done() and len(buf) == 2  # blocked, nothing dropped
        batch = await buf.get_batch(1, current_version=0)
        assert len(batch) == 1
        await asyncio.wait_for(third, 1.0)
        assert len(buf) == 2 and not buf.drops
        ledger.check()
        # taken groups stay buffered until the run has trained on them
        assert ledger.counts()["buffered"] == 3 and ledger.counts()["trained"] == 0

    asyncio.run(main())


def test_stale_groups_are_dropped_at_removal_and_retried():
    async def main():
        ledger = Ledger()
        retry: deque = deque()
        buf = GroupBuffer(capacity=8, max_staleness=1, ledger=ledger, retry=retry)
        old = _group(ledger, [1, 3])  # oldest token at version 1: pessimistic staleness
        fresh = _group(ledger, [3])
        await buf.put(old)
        await buf.put(fresh)
        batch = await buf.get_batch(1, current_version=3)
        assert batch == [fresh]
        c = ledger.counts()
        assert (c["dropped.stale"], c["buffered"]) == (1, 1)
        assert list(retry) == [old.prompt]
        m = buf.metrics(current_version=3)
        assert m["drops/stale"] == 1 and m["staleness/consumed_max"] == 0
        buf.clear(DropReason.RUN_ENDED)
        ledger.check()

    asyncio.run(main())


def test_drop_stale_after_a_weight_update():
    async def main():
        ledger = Ledger()
        buf = GroupBuffer(capacity=8, max_staleness=0, ledger=ledger)
        await buf.put(_group(ledger, [0]))
        await buf.put(_group(ledger, [1]))
        assert buf.drop_stale(current_version=1) == 1
        assert buf.metrics(1)["buffer/size"] == 1
        ledger.check()

    asyncio.run(main())


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        GroupBuffer(0, 1, Ledger())
    with pytest.raises(ValueError, match="max_staleness"):
        GroupBuffer(1, -1, Ledger())


@settings(max_examples=40, deadline=None)
@given(
    bound=st.integers(0, 3),
    capacity=st.integers(1, 6),
    plan=st.lists(
        st.tuples(st.integers(0, 4), st.booleans(), st.booleans()), min_size=1, max_size=30
    ),
)
def test_no_trained_group_exceeds_the_bound_and_the_ledger_balances(bound, capacity, plan):
    """A producer writes groups generated `lag` versions ago (some failing); a consumer
    trains and bumps the version. Every consumed group is within the bound; nothing is lost."""

    async def main():
        ledger = Ledger()
        buf = GroupBuffer(capacity=capacity, max_staleness=bound, ledger=ledger)
        version = 0
        trained: list[int] = []
        for lag, fails, consume in plan:
            g = _group(ledger, [max(0, version - lag)], finish="abort" if fails else "stop")
            if len(buf) >= capacity:  # make room first: put would block forever here
                buf.drop_stale(version)
            if len(buf) >= capacity:
                for group in await buf.get_batch(1, version):
                    trained.append(group.staleness(version))
                    ledger.train(group.group_id)
                version += 1
            if fails:  # judged at arrival: never buffered
                ledger.drop(g.group_id, DropReason.ABORTED)
            else:
                await buf.put(g)
            ledger.check()
            if consume and len(buf):
                ready = [x for x in buf._queue if x.staleness(version) <= bound]
                if ready:
                    for group in await buf.get_batch(1, version):
                        trained.append(group.staleness(version))
                        ledger.train(group.group_id)
                    version += 1
            ledger.check()
        assert all(s <= bound for s in trained)
        c = ledger.counts()
        assert c["produced"] == len(plan)
        assert c["produced"] == c["in_flight"] + c["buffered"] + c["trained"] + c["dropped"]

    asyncio.run(main())
