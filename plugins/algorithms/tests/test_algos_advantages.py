"""Advantage estimators on small tensors, with every expected number worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from miles_algorithms import advantages as est
from miles_algorithms.algorithms import PolicyGradient
from miles_algorithms.options import (
    DrGRPOOptions,
    GRPOOptions,
    PPOOptions,
    ReinforcePPBaselineOptions,
    ReinforcePPOptions,
)

from miles_core.contracts import TokenBatch

D = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def batch(rewards, group_index, mask, **kw) -> TokenBatch:
    mask = t(mask)
    return TokenBatch(
        response_mask=mask,
        rollout_logprobs=kw.pop("rollout", torch.zeros_like(mask)),
        rewards=t(rewards),
        group_index=torch.tensor(group_index),
        **kw,
    )


# Two interleaved groups with arbitrary labels: group 7 = rewards (1, 0, 0),
# group 3 = rewards (2, 4, 6). Two tokens each; sample 2 has only its first token trained.
REWARDS = [1.0, 2.0, 0.0, 4.0, 0.0, 6.0]
GROUPS = [7, 3, 7, 3, 7, 3]
MASK = [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]]


def expect_tokens(per_sample: list[float]) -> torch.Tensor:
    return t(per_sample).unsqueeze(-1) * t(MASK)


def test_grpo_group_std_unbiased() -> None:
    # group 7: mean 1/3, deviations (2/3, -1/3, -1/3); unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3
    #   -> A = (2/3) / sqrt(1/3) = 1.154700..., (-1/3) / sqrt(1/3) = -0.577350...
    # group 3: mean 4, deviations (-2, 0, 2); unbiased var = 8 / 2 = 4, std 2 -> A = -1, 0, 1
    b = batch(REWARDS, GROUPS, MASK)
    PolicyGradient(GRPOOptions(std_eps=0.0)).compute_advantages(b)
    s = math.sqrt(1 / 3)
    expected = expect_tokens([(2 / 3) / s, -1.0, (-1 / 3) / s, 0.0, (-1 / 3) / s, 1.0])
    torch.testing.assert_close(b.advantages, expected)
    assert b.advantages[0, 0] == pytest.approx(1.1547005, abs=1e-7)


def test_grpo_population_std() -> None:
    # group 3: population var = 8 / 3 -> std 1.632993 -> A = -2 / 1.632993 = -1.224745
    adv = est.grpo(t(REWARDS), torch.tensor(GROUPS), t(MASK), unbiased=False, eps=0.0)
    assert adv[1, 0] == pytest.approx(-1.2247449, abs=1e-7)
    assert adv[5, 1] == pytest.approx(1.2247449, abs=1e-7)
    # group 7: population var = (6/9) / 3 = 2/9 -> A = (2/3) / sqrt(2/9) = 1.414214
    assert adv[0, 0] == pytest.approx(math.sqrt(2), abs=1e-7)


def test_grpo_batch_std() -> None:
    # Centred by the group mean, divided by the std of all six rewards:
    # mean 13/6; sum of squares about the mean = 57 - 6 * (13/6)^2 = 173/6;
    # unbiased var = (173/6) / 5 = 173/30 -> std = 2.401388...
    b = batch(REWARDS, GROUPS, MASK)
    PolicyGradient(GRPOOptions(scale_rewards="batch", std_eps=0.0)).compute_advantages(b)
    std = math.sqrt(173 / 30)
    assert b.advantages[0, 0] == pytest.approx((2 / 3) / std)  # 0.277617
    assert b.advantages[1, 1] == pytest.approx(-2 / std)  # -0.832851
    assert b.advantages[2, 1] == 0.0  # masked token


def test_dr_grpo_no_std() -> None:
    # Dr. GRPO: r - group mean: (2/3, -2, -1/3, 0, -1/3, 2)
    b = batch(REWARDS, GROUPS, MASK)
    PolicyGradient(DrGRPOOptions()).compute_advantages(b)
    torch.testing.assert_close(b.advantages, expect_tokens([2 / 3, -2, -1 / 3, 0, -1 / 3, 2]))


def test_grpo_std_eps_is_added_to_the_std() -> None:
    # group (0, 2): mean 1, unbiased std sqrt(2) -> A = 1 / (sqrt(2) + 0.5) = 0.522408
    adv = est.grpo(t([0.0, 2.0]), torch.tensor([0, 0]), t([[1], [1]]), eps=0.5)
    assert adv[1, 0] == pytest.approx(1 / (math.sqrt(2) + 0.5))


def test_zero_variance_and_single_sample_groups_get_exactly_zero() -> None:
    # 0.1 is not exact in binary: the mean of three of them could round off 0.1; the
    # estimator must still give exactly 0, and a group of one has no baseline to compare with.
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0], dtype=torch.float32)
    adv = est.grpo(rewards, torch.tensor([0, 0, 0, 1]), torch.ones(4, 3))
    assert torch.equal(adv, torch.zeros(4, 3))


def test_grpo_kl_reward_shaping() -> None:
    # kl_mode='reward', k1 with the behaviour (here rollout) log-probs against the reference:
    # sample 0: k1 = (0.5, -0.1), sum 0.4 -> shaped reward 1 - 0.5 * 0.4 = 0.8
    # sample 1: k1 = (0.2, 0.0),  sum 0.2 -> shaped reward 0 - 0.5 * 0.2 = -0.1
    # Dr. GRPO: mean 0.35 -> A = (0.45, -0.45)
    b = batch(
        [1.0, 0.0],
        [0, 0],
        [[1, 1], [1, 1]],
        rollout=t([[-1.0, -2.0], [-1.0, -1.0]]),
        ref_logprobs=t([[-1.5, -1.9], [-1.2, -1.0]]),
    )
    opts = DrGRPOOptions(kl_coef=0.5, kl_type="k1", kl_mode="reward")
    PolicyGradient(opts).compute_advantages(b)
    torch.testing.assert_close(b.advantages, t([[0.45, 0.45], [-0.45, -0.45]]))


def test_discounted_returns_skip_masked_tokens() -> None:
    # mask (1, 0, 1, 1), reward 1 on the last token, gamma 0.5:
    # G3 = 1, G2 = 0.5 * 1 = 0.5, t=1 is masked (0, and skipped), G0 = 0.5 * 0.5 = 0.25
    mask = t([[1, 0, 1, 1]])
    rt = est.token_rewards(t([1.0]), mask)
    torch.testing.assert_close(rt, t([[0, 0, 0, 1]]))
    torch.testing.assert_close(est.discounted_returns(rt, mask, 0.5), t([[0.25, 0, 0.5, 1]]))


def test_reinforce_pp_kl_shaped_returns_whitened_over_the_batch() -> None:
    # kl_coef 0.5, k1 = rollout - ref:  row 0 (0.2, 0, 0.4), row 1 (0, 0.6, [masked])
    #   -> penalties row 0 (0.1, 0, 0.2), row 1 (0, 0.3)
    # token rewards: row 0 (-0.1, 0, 1 - 0.2) ; row 1 (0, 0 - 0.3)
    # returns (gamma 1): row 0 (0.7, 0.8, 0.8) ; row 1 (-0.3, -0.3)
    # whiten over the 5 tokens: mean 1.7 / 5 = 0.34;
    #   squares of (0.36, 0.46, 0.46, -0.64, -0.64) sum to 1.372 -> population var 0.2744
    b = batch(
        [1.0, 0.0],
        [0, 1],
        [[1, 1, 1], [1, 1, 0]],
        rollout=t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]),
        ref_logprobs=t([[-1.2, -1.0, -1.4], [-1.0, -1.6, -10.0]]),
    )
    PolicyGradient(ReinforcePPOptions(kl_coef=0.5, std_eps=0.0)).compute_advantages(b)
    std = math.sqrt(0.2744)
    expected = t([[0.36, 0.46, 0.46], [-0.64, -0.64, 0.0]]) / std
    torch.testing.assert_close(b.advantages, expected)
    assert b.advantages[0, 0] == pytest.approx(0.687243, abs=1e-6)


def test_reinforce_pp_discount() -> None:
    # One sample, 3 tokens, reward 1, gamma 0.5, second sample reward 0 over 1 token:
    # returns (0.25, 0.5, 1) and (0); mean over 4 tokens 1.75 / 4 = 0.4375;
    # deviations (-0.1875, 0.0625, 0.5625, -0.4375): squares sum 0.546875 -> var 0.13671875
    adv = est.reinforce_pp(t([1.0, 0.0]), t([[1, 1, 1], [1, 0, 0]]), gamma=0.5, eps=0.0)
    std = math.sqrt(0.13671875)
    torch.testing.assert_close(adv, t([[-0.1875, 0.0625, 0.5625], [-0.4375, 0, 0]]) / std)


def test_reinforce_pp_baseline() -> None:
    # groups (1, 0) and (0.5, 0.5): centred (0.5, -0.5, 0, 0) (the constant group exactly 0);
    # one token each, gamma 1 -> returns the same; whiten: mean 0, population var 0.5 / 4
    b = batch([1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1], [[1], [1], [1], [1]])
    PolicyGradient(ReinforcePPBaselineOptions(std_eps=0.0)).compute_advantages(b)
    s = math.sqrt(2)
    torch.testing.assert_close(b.advantages, t([[s], [-s], [0.0], [0.0]]))


def test_gae_by_hand() -> None:
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72)
    # row 0: values (0.5, 0.6, 0.7), reward 1 on the last token
    #   t2: delta = 1 - 0.7 = 0.3,                A2 = 0.3
    #   t1: delta = 0.9 * 0.7 - 0.6 = 0.03,       A1 = 0.03 + 0.72 * 0.3 = 0.246
    #   t0: delta = 0.9 * 0.6 - 0.5 = 0.04,       A0 = 0.04 + 0.72 * 0.246 = 0.21712
    #   returns = A + V = (0.71712, 0.846, 1.0)
    # row 1: mask (1, 0, 1), values (0.2, [9], 0.4), reward 2
    #   t2: delta = 2 - 0.4 = 1.6, A2 = 1.6; t1 masked (skipped);
    #   t0: delta = 0.9 * 0.4 - 0.2 = 0.16, A0 = 0.16 + 0.72 * 1.6 = 1.312; returns (1.512, 0, 2)
    b = batch(
        [1.0, 2.0],
        [0, 1],
        [[1, 1, 1], [1, 0, 1]],
        values=t([[0.5, 0.6, 0.7], [0.2, 9.0, 0.4]]),
    )
    opts = PPOOptions(gamma=0.9, gae_lambda=0.8, normalize_advantages=False)
    PolicyGradient(opts).compute_advantages(b)
    torch.testing.assert_close(b.advantages, t([[0.21712, 0.246, 0.3], [1.312, 0.0, 1.6]]))
    torch.testing.assert_close(b.returns, t([[0.71712, 0.846, 1.0], [1.512, 0.0, 2.0]]))


def test_gae_normalised() -> None:
    # The same first row alone, whitened: mean of (0.21712, 0.246, 0.3) = 0.25437333
    b = batch([1.0], [0], [[1, 1, 1]], values=t([[0.5, 0.6, 0.7]]))
    PolicyGradient(PPOOptions(gamma=0.9, gae_lambda=0.8)).compute_advantages(b)
    raw = t([0.21712, 0.246, 0.3])
    expected = (raw - raw.mean()) / (raw.var(correction=0).sqrt() + 1e-8)
    torch.testing.assert_close(b.advantages[0], expected)
    assert float(b.advantages.mean()) == pytest.approx(0.0, abs=1e-12)


def test_gae_with_lambda_one_is_return_minus_value() -> None:
    # lambda = 1, gamma = 1: A_t = R - V_t with R the final reward
    b = batch([3.0], [0], [[1, 1]], values=t([[1.0, 2.0]]))
    PolicyGradient(PPOOptions(gae_lambda=1.0, normalize_advantages=False)).compute_advantages(b)
    torch.testing.assert_close(b.advantages, t([[2.0, 1.0]]))


def test_grpo_per_turn_advantage_is_the_return_from_each_turn_on() -> None:
    # two samples of one group, two turns each: tokens 0-1 (turn 1), a tool's token 2 (not
    # trained), tokens 3-4 (turn 2). Sample 0 earns 1.0 for its first turn, sample 1 nothing;
    # both earn an episode reward of 0.0 and 1.0.
    mask = t([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]])
    turns = t([[0, 1.0, 0, 0, 0], [0, 0, 0, 0, 0]])
    rewards, groups = t([0.0, 1.0]), torch.tensor([0, 0])
    adv = est.grpo(rewards, groups, mask, scale="none", turn_rewards=turns)
    # G_0 = 1.0 and 1.0: the group's mean return is 1.0; G_turn2 = 0.0 and 1.0
    assert adv.tolist() == [[0.0, 0.0, 0.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    # all turn rewards 0: exactly GRPO's
    zero = est.grpo(rewards, groups, mask, scale="group", turn_rewards=torch.zeros_like(turns))
    assert torch.equal(zero, est.grpo(rewards, groups, mask, scale="group"))


def test_turn_rewards_reach_reinforce_pp_and_ppo_as_token_rewards() -> None:
    mask = t([[1, 1, 0, 1]])
    turns = t([[0, 0.5, 0, 0]])
    shaped = est.token_rewards(t([1.0]), mask, turn_rewards=turns)
    assert shaped.tolist() == [[0.0, 0.5, 0.0, 1.0]]
    returns = est.discounted_returns(shaped, mask, 1.0)
    assert returns.tolist() == [[1.5, 1.5, 0.0, 1.0]]
    batch = TokenBatch(
        response_mask=mask,
        rollout_logprobs=torch.zeros_like(mask),
        rewards=t([1.0]),
        group_index=torch.tensor([0]),
        turn_rewards=turns,
    )
    PolicyGradient(ReinforcePPOptions(gamma=1.0)).compute_advantages(batch)
    plain = TokenBatch(
        response_mask=mask,
        rollout_logprobs=torch.zeros_like(mask),
        rewards=t([1.0]),
        group_index=torch.tensor([0]),
    )
    PolicyGradient(ReinforcePPOptions(gamma=1.0)).compute_advantages(plain)
    assert batch.advantages is not None and plain.advantages is not None
    # whitened over the loss tokens: the first turn's tokens now rank above the last one's
    assert batch.advantages[0, 0] > batch.advantages[0, 3]
    assert torch.equal(plain.advantages[0, 0], plain.advantages[0, 3])
