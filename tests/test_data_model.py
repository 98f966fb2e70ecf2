"""Sample, Group and the Ledger."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.data import Group, Sample
from miles_core.ledger import Ledger, LedgerError


def _sample(*turns: tuple[int, int]) -> Sample:
    """A sample whose generated turns are (n_tokens, version), separated by tool tokens."""
    s = Sample(prompt_ids=[1, 2])
    for n, version in turns:
        s.append(list(range(n)), logprobs=[-0.1] * n, version=version)
        s.append([7, 7], trained=False)
    s.check()
    return s


def test_sample_tracks_versions_per_token_and_masks_environment_tokens():
    s = _sample((3, 4), (2, 5))
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0]
    assert s.versions == [4, 4, 4, -1, -1, 5, 5, -1, -1]
    assert s.oldest_version == 4


def test_group_oldest_version_is_pessimistic_over_all_tokens():
    g = Group(samples=[_sample((3, 6)), _sample((1, 6), (1, 4)), _sample((2, 7))])
    assert g.oldest_version == 4
    assert g.staleness(current_version=9) == 5
    assert g.num_generated_tokens == 3 + 2 + 2


def test_failed_sample_fails_the_group_and_bad_inputs_are_refused():
    s = _sample((2, 0))
    s.finish_reason = "abort"
    assert Group(samples=[_sample((1, 0)), s]).failed
    with pytest.raises(ValueError, match="finish_reason"):
        Sample(prompt_ids=[1], finish_reason="done")
    with pytest.raises(ValueError, match="log-prob"):
        Sample(prompt_ids=[1]).append([1, 2], logprobs=[-1.0], version=0)
    broken = _sample((2, 0))
    broken.logprobs.pop()
    with pytest.raises(ValueError, match="logprobs"):
        broken.check()


def test_ledger_transitions_and_counts():
    ledger = Ledger()
    for gid in range(5):
        ledger.start(gid)
    ledger.buffer(0)
    ledger.train(0)
    ledger.drop(1, "aborted")
    ledger.buffer(2)
    ledger.drop(2, "stale")
    ledger.train(3)  # synchronous: straight from in flight to trained
    assert ledger.counts() == {
        "in_flight": 1,
        "buffered": 0,
        "trained": 2,
        "dropped": 2,
        "dropped.aborted": 1,
        "dropped.stale": 1,
        "produced": 5,
    }
    ledger.check()
    with pytest.raises(LedgerError, match="cannot go from trained to buffered"):
        ledger.buffer(0)
    with pytest.raises(LedgerError, match="already produced"):
        ledger.start(4)
    with pytest.raises(LedgerError, match="unknown drop reason"):
        ledger.drop(4, "")
    restored = Ledger.from_state_dict(ledger.state_dict())
    assert restored.counts() == ledger.counts()


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.sampled_from(["start", "buffer", "train", "drop"])),
        max_size=80,
    )
)
def test_ledger_balances_under_any_sequence(ops):
    ledger = Ledger()
    for gid, op in ops:
        try:
            if op == "start":
                ledger.start(gid)
            elif op == "drop":
                ledger.drop(gid, "filtered")
            else:
                getattr(ledger, op)(gid)
        except LedgerError:
            pass  # refused transitions leave the ledger unchanged
        ledger.check()
        c = ledger.counts()
        assert c["produced"] == c["in_flight"] + c["buffered"] + c["trained"] + c["dropped"]


def test_group_ids_continue_after_a_resumed_ledger():
    from miles_core.data import reserve_group_ids

    ledger = Ledger()
    for _ in range(3):
        ledger.start(Group(samples=[]).group_id)
    restored = Ledger.from_state_dict(ledger.state_dict())
    reserve_group_ids(restored.next_id + 1000)
    new = Group(samples=[])
    assert new.group_id >= restored.next_id + 1000
    restored.start(new.group_id)
    assert Group(samples=[]).group_id > new.group_id


def test_counts_of_the_trained_samples_are_summed_per_step():
    from miles_core.runtime.metrics import group_metrics

    one = Sample(prompt_ids=[1], counts={"malformed_tool_calls": 2})
    two = Sample(prompt_ids=[1], counts={"malformed_tool_calls": 1, "retries": 3})
    metrics = group_metrics([Group([one, Sample(prompt_ids=[1])]), Group([two])])
    assert metrics["counts/malformed_tool_calls"] == 3.0 and metrics["counts/retries"] == 3.0
    assert one.to_dict()["counts"] == {"malformed_tool_calls": 2}
    assert not any(k.startswith("counts/") for k in group_metrics([Group([Sample([1])])]))


def test_turn_rewards_are_checked_against_the_generated_turns():
    from miles_core.builtins.rollouts import score

    s = Sample(prompt_ids=[1])
    s.append([5, 6], logprobs=[-0.1, -0.2], version=0)
    s.append([7], trained=False)  # a tool's output
    s.append([8], logprobs=[-0.3], version=0)
    assert s.turns() == [(0, 2), (3, 4)]

    def per_turn(sample, prompt):
        sample.turn_rewards = [0.5, 1]
        return 1.0

    score(s, {}, per_turn)
    assert s.reward == 1.0 and s.turn_rewards == [0.5, 1.0] and not s.failed
    s.check()

    def wrong(sample, prompt):
        sample.turn_rewards = [0.5]
        return 1.0

    bad = Sample(prompt_ids=[1])
    bad.append([5, 6], logprobs=[-0.1, -0.2], version=0)
    bad.append([7], trained=False)
    bad.append([8], logprobs=[-0.3], version=0)
    score(bad, {}, wrong)
    assert bad.failed and "not a list of 2 numbers" in bad.metadata["reward_error"]
    bad.finish_reason, bad.turn_rewards = "stop", [1.0]
    with pytest.raises(ValueError, match="turn_rewards has 1 values for 2 generated turns"):
        bad.check()
