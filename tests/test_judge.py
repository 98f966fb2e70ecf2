"""The judge: one verdict per finished group, with the reason from the one enum."""

from __future__ import annotations

import pytest

from miles_core.data import Group, Sample
from miles_core.ledger import DropReason, Ledger, LedgerError
from miles_core.plugins import create_plugin_manager
from miles_core.runtime.judge import Judge


def _group(*finishes: str, rewards=(0.0, 1.0), reward_error: bool = False) -> Group:
    samples = []
    for i, finish in enumerate(finishes):
        s = Sample(prompt_ids=[1], finish_reason=finish)
        s.append([5], logprobs=[-0.1], version=0)
        s.reward = rewards[i % len(rewards)]
        samples.append(s)
    if reward_error:
        samples[0].finish_reason = "error"
        samples[0].metadata["reward_error"] = "ZeroDivisionError: division by zero"
    return Group(samples=samples, prompt={"prompt": "p"})


def _judge(**kw) -> Judge:
    pm = create_plugin_manager(autoload=False, trace=False)
    from miles_core.hooks import Hooks

    return Judge(Hooks(pm), kw.get("sample", []), kw.get("group", []))


def test_each_failure_has_its_own_reason():
    judge = _judge()
    assert judge.verdict(_group("stop", "abort"), 1) is DropReason.ABORTED
    assert judge.verdict(_group("stop", "error"), 1) is DropReason.ENGINE_FAILED
    assert judge.verdict(_group("stop", "stop", reward_error=True), 1) is DropReason.REWARD_FAILED
    assert judge.verdict(_group("stop", "length"), 1) is None
    assert judge.samples_seen == 8 and judge.reward_failures == 1
    assert judge.reward_failure_rate == pytest.approx(1 / 8)


def test_filters_drop_as_filtered():
    judge = _judge(group=[lambda g: len(set(g.rewards)) > 1], sample=[lambda s: s.reward > 0])
    assert judge.verdict(_group("stop", "stop", rewards=(1.0, 1.0)), 1) is DropReason.FILTERED
    # the sample filter leaves one sample; the group filter then sees no variance
    assert judge.verdict(_group("stop", "stop"), 1) is DropReason.FILTERED
    assert _judge(sample=[lambda s: False]).verdict(_group("stop"), 1) is DropReason.FILTERED


def test_the_ledger_takes_only_the_enum():
    ledger = Ledger()
    ledger.start(1)
    with pytest.raises(LedgerError, match="allowed: aborted, engine_failed"):
        ledger.drop(1, "made_up")  # type: ignore[arg-type]
    ledger.drop(1, DropReason.REWARD_FAILED)
    assert ledger.counts()["dropped.reward_failed"] == 1
