"""The core's side of a run that trains several adapters: prompts from each adapter's source in
turn, the adapter kept with a retried prompt, the ledger and the step metrics per adapter."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from miles_core.buffer import GroupBuffer
from miles_core.data import Group, Prompt, Sample
from miles_core.ledger import Ledger
from miles_core.runtime.adapters import AdapterPrompts
from miles_core.runtime.metrics import group_metrics


class _Source:
    """``n`` records tagged with ``tag``, resumable by position."""

    def __init__(self, tag: str, n: int) -> None:
        self.tag, self.n, self.index, self.skipped = tag, n, 0, 1

    def __iter__(self) -> Any:
        while self.index < self.n:
            self.index += 1
            yield {"prompt": f"{self.tag}{self.index - 1}"}

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


def _take(source: AdapterPrompts, n: int) -> list[tuple[str | None, str]]:
    out = []
    for prompt in source:
        assert isinstance(prompt, Prompt)
        out.append((prompt.adapter, prompt["prompt"]))
        if len(out) == n:
            break
    return out


def test_each_adapter_gets_its_own_prompts_in_turn_until_the_last_runs_out() -> None:
    source = AdapterPrompts({"a": _Source("a", 3), "b": _Source("b", 1)})
    assert _take(source, 10) == [("a", "a0"), ("b", "b0"), ("a", "a1"), ("a", "a2")]
    assert source.exhausted == {"a", "b"} and source.skipped == 2


def test_the_prompt_order_resumes_from_its_state() -> None:
    whole = _take(AdapterPrompts({"a": _Source("a", 4), "b": _Source("b", 4)}), 8)
    first = AdapterPrompts({"a": _Source("a", 4), "b": _Source("b", 4)})
    head = _take(first, 3)
    again = AdapterPrompts({"a": _Source("a", 4), "b": _Source("b", 4)})
    again.load_state_dict(first.state_dict())
    assert head + _take(again, 5) == whole
    other = AdapterPrompts({"a": _Source("a", 4), "c": _Source("c", 4)})
    with pytest.raises(ValueError, match=r"adapters \['a', 'b'\] are not this run's"):
        other.load_state_dict(first.state_dict())


def _group(gid: int, adapter: str | None, reward: float) -> Group:
    sample = Sample(prompt_ids=[1], adapter=adapter)
    sample.append([2, 3], logprobs=[-0.5, -0.5], version=0)
    sample.reward = reward
    return Group(
        samples=[sample], prompt=Prompt({"p": gid}, adapter), group_id=gid, adapter=adapter
    )


def test_the_ledger_counts_and_keeps_each_adapters_groups() -> None:
    ledger = Ledger()
    ledger.start(0, "a")
    ledger.start(1, "b")
    ledger.start(2, "a")
    ledger.train(0)
    ledger.drop(1, "filtered")
    counts = ledger.counts()
    assert counts["adapter.a.trained"] == 1 and counts["adapter.a.in_flight"] == 1
    assert counts["adapter.b.dropped"] == 1 and counts["adapter.b.produced"] == 1
    ledger.check()
    restored = Ledger.from_state_dict(ledger.state_dict())
    assert restored.counts() == counts and restored.adapter(2) == "a"


def test_a_retried_prompt_keeps_its_adapter() -> None:
    async def go() -> deque[dict[str, Any]]:
        ledger = Ledger()
        retry: deque[dict[str, Any]] = deque()
        buf = GroupBuffer(capacity=4, max_staleness=0, ledger=ledger, retry=retry)
        group = _group(7, "b", 1.0)
        group.prompt = {"p": 7}  # a rollout function that copied the record
        ledger.start(7, "b")
        buf.drop(group, "filtered")
        return retry

    (prompt,) = asyncio.run(go())
    assert isinstance(prompt, Prompt) and prompt.adapter == "b" and prompt == {"p": 7}


def test_step_metrics_per_adapter() -> None:
    metrics = group_metrics([_group(0, "a", 1.0), _group(1, "b", 0.0), _group(2, "a", 0.0)])
    assert metrics["adapter/a/groups"] == 2.0 and metrics["adapter/a/reward_mean"] == 0.5
    assert metrics["adapter/b/reward_mean"] == 0.0 and metrics["reward/mean"] == pytest.approx(
        1 / 3
    )
    assert not any(k.startswith("adapter/") for k in group_metrics([_group(3, None, 1.0)]))
