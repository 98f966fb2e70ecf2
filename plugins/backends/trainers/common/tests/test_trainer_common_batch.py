"""Groups to padded tensors, the algorithm's TokenBatch, and the micro-batch plans."""

from __future__ import annotations

import math
import random

import pytest
import torch
from miles_trainer_common.batch import (
    assign_to_ranks,
    pack,
    plan_by_length,
    plan_groups,
    plan_micro_batches,
    token_batch,
)

from miles_core.data import Group, Sample


def make_groups(n_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[Group]:
    """Groups of random prompts and responses of varied lengths; one sample per group has
    untrained (loss_mask 0) tokens in the middle, as a multi-turn trajectory does."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randint(2, 6))]
        samples = []
        for i in range(group_size):
            s = Sample(prompt_ids=list(prompt))
            n = rng.randint(2, 7)
            s.append(
                [rng.randrange(1, 64) for _ in range(n)],
                logprobs=[-rng.uniform(3.0, 5.0) for _ in range(n)],
                version=0,
            )
            if i == 1:
                s.append([rng.randrange(1, 64) for _ in range(2)], trained=False)
                s.append([rng.randrange(1, 64)], logprobs=[-4.0], version=0)
            s.reward = float((i + g) % 2)
            samples.append(s)
        groups.append(Group(samples=samples, prompt={"prompt": f"p{g}"}))
    return groups


def test_pack_pads_the_samples_in_group_order() -> None:
    groups = make_groups(n_groups=2, group_size=3, seed=1)
    samples = [s for g in groups for s in g.samples]
    packed = pack(groups)
    assert packed.size == 6
    assert packed.width == max(len(s.response_ids) for s in samples)
    assert packed.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert packed.rewards.tolist() == [s.reward for s in samples]
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        n = len(s.response_ids)
        assert packed.input_ids[i, : len(ids)].tolist() == ids
        assert (packed.input_ids[i, len(ids) :] == 0).all()
        assert int(packed.seq_lens[i]) == len(ids)
        assert packed.response_mask[i, :n].tolist() == [float(m) for m in s.loss_mask]
        assert (packed.response_mask[i, n:] == 0).all()
        torch.testing.assert_close(packed.rollout_logprobs[i, :n], torch.tensor(s.logprobs))
    # The untrained (environment) tokens of a multi-turn sample are masked out.
    assert packed.response_mask[1].tolist().count(0.0) >= 2


def test_pack_carries_the_teachers_logprobs() -> None:
    groups = make_groups(n_groups=2, group_size=2, seed=3)
    samples = [s for g in groups for s in g.samples]
    assert pack(groups).teacher_logprobs is None
    assert token_batch(pack(groups)).teacher_logprobs is None
    for k, s in enumerate(samples):
        s.teacher_logprobs = [-0.5 - k - j / 10 for j in range(len(s.response_ids))]
    packed = pack(groups)
    assert packed.teacher_logprobs is not None
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        torch.testing.assert_close(packed.teacher_logprobs[i, :n], torch.tensor(s.teacher_logprobs))
        assert (packed.teacher_logprobs[i, n:] == 0).all()
    batch = token_batch(packed)
    assert torch.equal(batch.teacher_logprobs, packed.teacher_logprobs)
    samples[2].teacher_logprobs = None
    with pytest.raises(ValueError, match=r"samples \[2\] have no teacher log-probs"):
        pack(groups)
    samples[2].teacher_logprobs = [0.0]
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries"):
        pack(groups)


def test_pack_refuses_malformed_input() -> None:
    with pytest.raises(ValueError, match="no samples"):
        pack([])
    groups = make_groups(n_groups=1, group_size=2)
    groups[0].samples[1].prompt_ids = []
    with pytest.raises(ValueError, match="empty prompt"):
        pack(groups)
    groups = make_groups(n_groups=1, group_size=2)
    groups[0].samples[0].logprobs.pop()
    with pytest.raises(ValueError):
        pack(groups)


def test_token_batch_copies_and_needs_rewards() -> None:
    groups = make_groups(n_groups=2, group_size=2, seed=2)
    packed = pack(groups)
    batch = token_batch(packed)
    assert torch.equal(batch.response_mask, packed.response_mask)
    assert torch.equal(batch.rewards, packed.rewards)
    batch.rewards += 1  # the algorithm may write into its batch: the packed one stays
    assert not torch.equal(batch.rewards, packed.rewards)
    groups[1].samples[0].reward = None
    packed = pack(groups)
    assert math.isnan(float(packed.rewards[2]))
    with pytest.raises(ValueError, match=r"samples \[2\] have no reward"):
        token_batch(packed)


def test_micro_batch_plan() -> None:
    lens = [5, 3, 8, 2, 2, 9]
    plan = plan_micro_batches(lens, 16)
    assert plan == [[0, 1], [2, 3], [4], [5]]
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    for mb in plan:
        assert len(mb) == 1 or len(mb) * max(lens[i] for i in mb) <= 16
    assert plan_micro_batches(lens, 1) == [[i] for i in range(6)]
    assert plan_micro_batches(lens, 10_000) == [list(range(6))]


def test_plan_by_length_groups_similar_lengths() -> None:
    lens = [5, 3, 8, 2, 2, 9]
    plan = plan_by_length(lens, 16)
    # Longest first (ties in order): 9, 8 | 5, 3 | 2, 2, 2 ... each within the budget.
    assert plan == [[5], [2, 0], [1, 3, 4]]
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    padded = sum(len(mb) * max(lens[i] for i in mb) for mb in plan)
    in_order = sum(len(mb) * max(lens[i] for i in mb) for mb in plan_micro_batches(lens, 16))
    assert padded < in_order
    assert plan_by_length(lens, 10_000) == [[5, 2, 0, 1, 3, 4]]


def test_plan_groups_keeps_groups_whole() -> None:
    packed = pack(make_groups(n_groups=4, group_size=3, seed=5))
    for budget in (1, 30, 10_000):
        plan = plan_groups(packed, budget)
        assert sorted(i for mb in plan for i in mb) == list(range(12))
        for mb in plan:
            in_mb = {int(packed.group_index[i]) for i in mb}
            whole = [i for i in range(12) if int(packed.group_index[i]) in in_mb]
            assert sorted(mb) == whole
    assert len(plan_groups(packed, 1)) == 4 and len(plan_groups(packed, 10_000)) == 1


def test_assign_to_ranks_balances_padded_tokens() -> None:
    lens = [9, 8, 5, 3, 2, 2]
    plan = [[0], [1], [2, 3], [4, 5]]  # costs 9, 8, 10, 4
    per_rank = assign_to_ranks(plan, lens, 2)
    # Largest first to the least-loaded rank: 10 -> r0, 9 -> r1, 8 -> r1, 4 -> r0.
    assert per_rank == [[[2, 3], [4, 5]], [[0], [1]]]
    assert assign_to_ranks(plan, lens, 1) == [plan]
    # More ranks than micro-batches: the extra ranks get none (they run padding passes).
    assert assign_to_ranks([[0]], lens, 3) == [[[0]], [], []]
