"""Admission control of the fully asynchronous schedule: the estimate, and the real schedule
holding and starting groups over a real engine fleet of fake engines (instant generation, a
transport that records the weight updates), a fake trainer that takes batches and publishes."""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from core_support import IdleEngineClient

from miles_core.buffer import GroupBuffer
from miles_core.config.schema import BufferSection
from miles_core.data import Group, Sample
from miles_core.ledger import DropReason, Ledger
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.judge import Judge
from miles_core.runtime.schedules import ScheduleContext
from miles_core.runtime.schedules.admission import Admission, consumed_at
from miles_core.runtime.schedules.asynchronous import AsyncSchedule

# --- the estimate ---------------------------------------------------------------------------


def test_consumed_at_counts_the_groups_ahead_in_steps() -> None:
    # the trainer waits at version 3 with nothing taken: 0..3 groups ahead go in this batch
    assert [consumed_at(ahead=a, taken=0, per_step=4, version=3) for a in range(9)] == [
        3, 3, 3, 3, 4, 4, 4, 4, 5,
    ]  # fmt: skip
    # its batch holds 3 of 4: one more group fills it, the next goes in the following one
    assert consumed_at(ahead=0, taken=3, per_step=4, version=3) == 3
    assert consumed_at(ahead=1, taken=3, per_step=4, version=3) == 4
    # while it trains on its whole batch, the next batch is taken at the next version
    assert consumed_at(ahead=0, taken=4, per_step=4, version=3) == 4
    with pytest.raises(ValueError, match="per_step"):
        consumed_at(ahead=0, taken=0, per_step=0, version=0)
    with pytest.raises(ValueError, match="ahead and taken"):
        consumed_at(ahead=-1, taken=0, per_step=1, version=0)


def test_admission_holds_a_group_that_would_be_taken_beyond_the_bound() -> None:
    rule = Admission(max_staleness=1, per_step=2)
    # engine and trainer at version 5: two batches' worth of groups may be ahead
    assert rule.admits(ahead=3, taken=0, version=5, start_version=5)
    assert rule.estimate(ahead=4, taken=0, version=5, start_version=5) == 2
    assert not rule.admits(ahead=4, taken=0, version=5, start_version=5)
    # while the trainer trains on its batch, one batch less may be ahead
    assert rule.admits(ahead=1, taken=2, version=5, start_version=5)
    assert not rule.admits(ahead=2, taken=2, version=5, start_version=5)
    # an engine on older weights makes the group older from its first token
    assert not rule.admits(ahead=1, taken=0, version=6, start_version=4)
    # bound 0: nothing may start while the trainer trains (it would be taken one version on)
    zero = Admission(max_staleness=0, per_step=2)
    assert not zero.admits(ahead=0, taken=2, version=5, start_version=5)
    assert zero.admits(ahead=1, taken=0, version=5, start_version=5)


def test_admission_never_holds_the_group_a_waiting_trainer_needs() -> None:
    rule = Admission(max_staleness=0, per_step=2)
    # an engine far behind, but the trainer waits with nothing ahead: holding would stop the run
    assert rule.admits(ahead=0, taken=1, version=9, start_version=2)
    assert not rule.admits(ahead=1, taken=0, version=9, start_version=2)
    off = Admission(max_staleness=0, per_step=2, enabled=False)
    assert off.admits(ahead=100, taken=2, version=9, start_version=2)


def test_admission_counts_holds_and_the_time_held() -> None:
    rule = Admission(max_staleness=1, per_step=2)
    rule.hold(10.0)
    rule.hold(10.5)  # the same hold goes on
    rule.release(11.0)
    rule.release(11.5)  # nothing held: nothing counted
    rule.hold(12.0)
    assert rule.holding
    window = rule.take_window(4.0, now=13.0)
    assert window == {
        "admission/held": 2.0,
        "admission/held_s": 2.0,
        "admission/held_fraction": 0.5,
    }
    # the hold still going on counts in the next window from where this one ended
    rule.release(13.5)
    assert rule.take_window(1.0, now=14.0)["admission/held_s"] == 0.5
    with pytest.raises(ValueError, match="max_staleness"):
        Admission(-1, 1)
    with pytest.raises(ValueError, match="per_step"):
        Admission(1, 0)


# --- the buffer's order ---------------------------------------------------------------------


def _group(ledger: Ledger, version: int) -> Group:
    sample = Sample(prompt_ids=[1], finish_reason="stop")
    sample.append([5], logprobs=[-0.1], version=version)
    group = Group(samples=[sample], prompt={"prompt": f"v{version}"})
    ledger.start(group.group_id)
    return group


@pytest.mark.parametrize("oldest_first", [True, False])
def test_the_trainer_takes_the_oldest_weights_first(oldest_first: bool) -> None:
    async def main() -> list[int]:
        ledger = Ledger()
        buf = GroupBuffer(8, 3, ledger, oldest_first=oldest_first)
        for version in (3, 2, 3, 1, 2):  # a group of version 1 generated for long
            await buf.put(_group(ledger, version))
        taken = await buf.get_batch(5, current_version=3)
        assert buf.taken == 5
        await buf.prune(4)
        assert buf.taken == 0
        return [g.oldest_version or 0 for g in taken]

    order = asyncio.run(main())
    assert order == ([1, 2, 2, 3, 3] if oldest_first else [3, 2, 3, 1, 2])


# --- the schedule ---------------------------------------------------------------------------


@dataclass
class Result:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    weight_version: str | None = None
    routed_experts: Any = None


class InstantClient(IdleEngineClient):
    """An engine whose every generation finishes at once with one token."""

    async def generate(self, input_ids: list[int], params: dict, **kwargs: Any) -> Result:
        await asyncio.sleep(0)
        return Result(output_ids=[7], logprobs=[-0.5])

    async def get_server_info(self) -> dict[str, Any]:
        return {"max_running_requests": 64}


class OneEngine:
    num_engines = 1

    def launch(self, model_path: str, index: int) -> str:
        return f"http://127.0.0.1:{9000 + index}"

    def client(self, url: str) -> InstantClient:
        return InstantClient(url)

    def stop(self, index: int) -> None:
        pass


class RecordingTransport:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def send(self, weights: Any, *, version: int, engines: list[str]) -> dict[str, float]:
        self.versions.append(version)
        return {"bytes": 1.0}


class OneTokenRollouts:
    """The part of the run's rollouts the schedule uses: prompts from a list, a group of one
    sample of one token generated through the schedule's engine view."""

    def __init__(self, ledger: Ledger, prompts: int) -> None:
        self.ledger = ledger
        self.retry: deque[dict[str, Any]] = deque()
        self.exhausted = False
        self.started = 0
        self._prompts = iter({"prompt": f"p{i}"} for i in range(prompts))

    def next_prompt(self) -> dict[str, Any] | None:
        if self.retry:
            return self.retry.popleft()
        prompt = next(self._prompts, None)
        self.exhausted = prompt is None
        return prompt

    async def group(self, prompt: dict[str, Any], engine: Any, step: int, *, teach: bool) -> Group:
        group = Group(samples=[], prompt=prompt)
        self.ledger.start(group.group_id)
        self.started += 1
        result = await engine.generate([1, 2], {"max_new_tokens": 1})
        sample = Sample(prompt_ids=[1, 2], finish_reason="length")
        sample.append(result.output_ids, logprobs=result.logprobs, version=0)
        group.samples.append(sample)
        return group

    async def teach(self, group: Group) -> None:
        pass


class NoHooks:
    def group_finished(self, group: Group, step: int) -> None:
        pass


def _run(admission: bool, steps: int) -> tuple[list[dict[str, float]], Ledger, list[int]]:
    """``steps`` steps of a fake trainer over the real schedule: bound 1, two groups a step,
    a buffer of 8 groups; the metrics of each step, the ledger, each batch's staleness."""
    ledger = Ledger()
    transport = RecordingTransport()
    config = SimpleNamespace(
        buffer=BufferSection(capacity=8, max_staleness=1, admission=admission),
        rollout=SimpleNamespace(group_size=1, groups_per_step=2),
    )

    async def main() -> tuple[list[dict[str, float]], list[int]]:
        fleet = EngineFleet(
            OneEngine(),  # type: ignore[arg-type]
            transport,  # type: ignore[arg-type]
            model_path="m",
            weights=lambda: nullcontext([]),
            log=lambda line: None,
        )
        await fleet.start(0)
        schedule = AsyncSchedule()
        schedule.attach(
            ScheduleContext(
                config=config,  # type: ignore[arg-type]
                fleet=fleet,
                rollouts=OneTokenRollouts(ledger, 400),  # type: ignore[arg-type]
                judge=Judge(NoHooks(), [], []),  # type: ignore[arg-type]
                ledger=ledger,
                log=lambda line: None,
            )
        )
        rows, staleness = [], []
        for step in range(1, steps + 1):
            groups, _ = await schedule.next_batch(step)
            version = step - 1
            staleness += [g.staleness(version) for g in groups]
            for _ in range(3):  # the trainer trains: the producer runs meanwhile
                await asyncio.sleep(0.01)
            for group in groups:
                ledger.train(group.group_id)
            await schedule.publish(step)
            rows.append(await schedule.metrics(step))
            ledger.check()
        await schedule.stop()
        await fleet.close()
        return rows, staleness

    rows, staleness = asyncio.run(main())
    assert transport.versions == list(range(1, steps + 1))
    return rows, ledger, staleness


def test_the_schedule_starts_only_groups_the_trainer_takes_within_the_bound() -> None:
    rows, ledger, staleness = _run(admission=True, steps=5)
    counts = ledger.counts()
    assert counts["trained"] == 10 and all(s <= 1 for s in staleness)
    # nothing was generated only to be discarded: every group dropped was dropped as the run
    # ended (still queued or in flight), none as stale
    assert counts.get("dropped.stale", 0) == 0 and all(r.get("drops/stale", 0) == 0 for r in rows)
    assert counts["produced"] == counts["trained"] + counts["dropped"]
    # the producer held groups back at every step, and said for how long
    assert all(r["admission/held"] >= 1 and r["admission/held_s"] > 0 for r in rows), rows
    # at most the bound's worth of groups ahead of the trainer: two steps of two groups
    assert all(r["buffer/size"] + r["rollout/groups_in_flight"] <= 4 for r in rows), rows


def test_without_admission_the_producer_runs_ahead_and_the_discard_bounds_staleness() -> None:
    rows, ledger, staleness = _run(admission=False, steps=5)
    counts = ledger.counts()
    assert counts["trained"] == 10 and all(s <= 1 for s in staleness)
    # the full buffer ran two versions ahead: its groups went stale, counted by reason
    assert counts["dropped.stale"] > 0 and rows[-1]["drops/stale"] == counts["dropped.stale"]
    assert all(r["admission/held"] == 0 and r["admission/held_s"] == 0 for r in rows)
    assert counts["produced"] == counts["trained"] + counts["dropped"]


def test_a_group_dropped_at_removal_wakes_a_held_producer() -> None:
    """The groups ahead of a held one go down when the trainer drops one as stale: the
    producer is told, and starts the group the trainer now needs."""

    async def main() -> None:
        ledger = Ledger()
        buf = GroupBuffer(8, 0, ledger)
        woken: list[int] = []
        buf.on_leave = lambda: woken.append(len(buf))
        await buf.put(_group(ledger, 0))
        await buf.put(_group(ledger, 1))
        batch = await buf.get_batch(1, current_version=1)
        assert [g.oldest_version for g in batch] == [1]
        assert woken == [1, 0]  # the stale one, then the one taken
        assert buf.drops[DropReason.STALE.value] == 1
        ledger.check()

    asyncio.run(main())
