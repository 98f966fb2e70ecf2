"""Losses on small tensors, with values and gradients worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from miles_algorithms.algorithms import (
    SFT,
    OnPolicyDistillation,
    PolicyGradient,
    explained_variance,
)
from miles_algorithms.masked import aggregate, kl_estimate
from miles_algorithms.options import (
    CriticOptions,
    DistillationOptions,
    GRPOOptions,
    GSPOOptions,
    PPOOptions,
    SFTOptions,
)

from miles_core.contracts import TokenBatch

D = torch.float64
LN = math.log


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def leaf(x: object) -> torch.Tensor:
    return t(x).requires_grad_(True)


def batch(mask, advantages, rollout=None, **kw) -> TokenBatch:
    mask = t(mask)
    return TokenBatch(
        response_mask=mask,
        rollout_logprobs=t(rollout) if rollout is not None else torch.zeros_like(mask),
        rewards=torch.zeros(mask.shape[0], dtype=D),
        group_index=torch.arange(mask.shape[0]),
        advantages=t(advantages) if advantages is not None else None,
        **kw,
    )


def test_ppo_clip_with_clip_higher() -> None:
    # Behaviour log-probs 0, so ratio = exp(logprobs) = (1.5, 0.5, 1.1, 0.7); eps 0.2 / 0.28.
    #   r=1.5, A=+1: max(-1.5, -1.28) = -1.28  (clipped high: no gradient)
    #   r=0.5, A=+1: max(-0.5, -0.8)  = -0.5   (not clipped: gradient -A r = -0.5)
    #   r=1.1, A=-1: max(1.1, 1.1)    = 1.1    (inside: gradient 1.1)
    #   r=0.7, A=-1: max(0.7, 0.8)    = 0.8    (clipped low: no gradient)
    # token mean = (-1.28 - 0.5 + 1.1 + 0.8) / 4 = 0.03
    logprobs = leaf([[LN(1.5), LN(0.5), LN(1.1), LN(0.7)]])
    b = batch([[1, 1, 1, 1]], [[1.0, 1.0, -1.0, -1.0]])
    opts = GRPOOptions(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token_mean")
    loss, m = PolicyGradient(opts).loss(b, logprobs)
    assert loss.item() == pytest.approx(0.03)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[0.0, -0.125, 0.275, 0.0]]))
    assert m["clip_fraction"] == 0.5
    assert m["clip_fraction/low"] == 0.25 and m["clip_fraction/high"] == 0.25
    assert m["ratio/mean"] == pytest.approx(0.95)
    assert m["ratio/max"] == pytest.approx(1.5) and m["ratio/min"] == pytest.approx(0.5)
    # approx KL = mean(r - 1 - ln r)
    expect_kl = sum(r - 1 - LN(r) for r in (1.5, 0.5, 1.1, 0.7)) / 4
    assert m["approx_kl"] == pytest.approx(expect_kl)
    assert all(isinstance(v, float) for v in m.values())


def test_dual_clip() -> None:
    # c = 3, eps 0.2 / 0.28:
    #   r=5, A=-1: max(5, 1.2) = 5, dual: min(5, 3) = 3   (no gradient)
    #   r=2, A=-1: max(2, 1.2) = 2, dual: min(2, 3) = 2   (gradient -A r = 2)
    #   r=5, A=+1: max(-5, -1.28) = -1.28, dual clip leaves positive advantages alone
    # mean = (3 + 2 - 1.28) / 3 = 1.24
    logprobs = leaf([[LN(5), LN(2), LN(5)]])
    b = batch([[1, 1, 1]], [[-1.0, -1.0, 1.0]])
    opts = GRPOOptions(clip_eps_high=0.28, dual_clip_c=3.0, loss_agg="token_mean")
    loss, m = PolicyGradient(opts).loss(b, logprobs)
    assert loss.item() == pytest.approx(1.24)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[0.0, 2 / 3, 0.0]]))
    assert m["dual_clip_fraction"] == pytest.approx(1 / 3)


def test_aggregations() -> None:
    # per-token (1, 2, 3 | 4, -, -), mask (1, 1, 1 | 1, 0, 0)
    x, mask = t([[1, 2, 3], [4, 9, 9]]), t([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(10 / 4)  # 2.5
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx(3.0)  # (2 + 4)/2
    assert float(aggregate(x, mask, "constant", 5)) == pytest.approx(1.0)  # 10 / (2 * 5)
    assert float(aggregate(x, mask, "constant")) == pytest.approx(10 / 6)  # default L = T = 3


def test_dr_grpo_constant_normaliser_in_the_loss() -> None:
    # ratio 1 everywhere, A = 1 on 3 tokens: sum of -1 * 3 over (B=2) * L=4 = -0.375
    logprobs = leaf([[0.0, 0.0], [0.0, 0.0]])
    b = batch([[1, 1], [1, 0]], [[1.0, 1.0], [1.0, 0.0]])
    opts = GRPOOptions(estimator="dr_grpo", loss_agg="constant", max_response_length=4)
    loss, _ = PolicyGradient(opts).loss(b, logprobs)
    assert loss.item() == pytest.approx(-0.375)
    loss.backward()
    # every trained token's gradient is -1 / 8, regardless of its sequence's length
    torch.testing.assert_close(logprobs.grad, t([[-0.125, -0.125], [-0.125, 0.0]]))


def test_kl_estimators() -> None:
    # pi = 0.5, pi_ref = 0.25: d = ln 2 = 0.693147
    # k1 = 0.693147; k2 = d^2 / 2 = 0.240227; k3 = e^-d + d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    lp, ref = t([LN(0.5)]), t([LN(0.25)])
    assert float(kl_estimate(lp, ref, "k1")) == pytest.approx(0.6931472)
    assert float(kl_estimate(lp, ref, "k2")) == pytest.approx(0.2402265)
    assert float(kl_estimate(lp, ref, "k3")) == pytest.approx(0.1931472)


@pytest.mark.parametrize(
    "kl_type,value,grad",
    [
        # d(k1)/dlp = 1;  d(k2)/dlp = d = ln 2;  d(k3)/dlp = 1 - e^-d = 0.5
        ("k1", LN(2), 1.0),
        ("k2", LN(2) ** 2 / 2, LN(2)),
        ("k3", 0.5 + LN(2) - 1, 0.5),
    ],
)
def test_kl_as_a_loss_term(kl_type: str, value: float, grad: float) -> None:
    # Zero advantages: the loss is kl_coef * mean KL over the 2 tokens (both with d = ln 2).
    logprobs = leaf([[LN(0.5), LN(0.5)]])
    b = batch([[1, 1]], [[0.0, 0.0]], ref_logprobs=t([[LN(0.25), LN(0.25)]]))
    opts = GRPOOptions(kl_coef=0.1, kl_type=kl_type, loss_agg="token_mean")
    loss, m = PolicyGradient(opts).loss(b, logprobs)
    assert loss.item() == pytest.approx(0.1 * value)
    assert m["kl_ref"] == pytest.approx(value)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[0.1 * grad / 2, 0.1 * grad / 2]]))


def test_kl_in_reward_mode_adds_no_loss_term() -> None:
    logprobs = leaf([[LN(0.5)]])
    b = batch([[1]], [[0.0]], ref_logprobs=t([[LN(0.25)]]))
    loss, m = PolicyGradient(GRPOOptions(kl_coef=0.1, kl_mode="reward")).loss(b, logprobs)
    assert loss.item() == 0.0 and "kl_ref" not in m


def test_entropy_bonus() -> None:
    # loss = 0 (zero advantages) - 0.1 * mean(1, 2) = -0.15; d/d entropy = -0.1 / 2
    logprobs = leaf([[0.0, 0.0]])
    entropy = leaf([[1.0, 2.0]])
    opts = GRPOOptions(entropy_coef=0.1)
    loss, m = PolicyGradient(opts).loss(batch([[1, 1]], [[0.0, 0.0]]), logprobs, entropy=entropy)
    assert loss.item() == pytest.approx(-0.15)
    assert m["entropy"] == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(entropy.grad, t([[-0.05, -0.05]]))


def test_gspo_sequence_ratio_and_clip() -> None:
    # row 0: token ratios (1.2, 0.8): s = exp((ln 1.2 + ln 0.8) / 2) = sqrt(0.96) = 0.9797959,
    #   inside [1 - 3e-4, 1 + 4e-4]? no: below 1 - 3e-4, but A = +1 so the low clip does not
    #   bind: loss = -s; gradient d(-s)/d lp_t = -s / 2 = -0.4898979 on each token.
    # row 1: token ratios (2, 2): s = 2 > 1.0004, A = +1: clipped, loss = -1.0004, gradient 0.
    # seq-mean-token-mean: (-0.9797959 - 1.0004) / 2
    logprobs = leaf([[LN(1.2), LN(0.8)], [LN(2), LN(2)]])
    b = batch([[1, 1], [1, 1]], [[1.0, 1.0], [1.0, 1.0]])
    loss, m = PolicyGradient(GSPOOptions()).loss(b, logprobs)
    s = math.sqrt(0.96)
    assert loss.item() == pytest.approx((-s - 1.0004) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-s / 4, -s / 4], [0.0, 0.0]]))
    assert m["ratio/max"] == pytest.approx(2.0) and m["ratio/min"] == pytest.approx(s)
    assert m["clip_fraction"] == 0.5  # one of the two sequences


def behaviour_batch(**kw) -> TokenBatch:
    # old - rollout = (ln 3, ln 0.5): raw weights (3, 0.5), product 1.5
    return batch(
        [[1, 1]],
        [[1.0, 1.0]],
        rollout=[[-LN(3), -LN(0.5)]],
        old_logprobs=t([[0.0, 0.0]]),
        **kw,
    )


@pytest.mark.parametrize(
    "correction,level,is_max,is_min,expected,fraction",
    [
        # ratio vs old = 1, A = 1 -> per-token -1 times the weight; token mean
        ("tis", "token", 2.0, None, (-2.0 - 0.5) / 2, 0.5),  # weights (min(3, 2), 0.5)
        ("mis", "token", 2.0, 0.4, (0.0 - 0.5) / 2, 0.5),  # 3 > 2 masked, 0.5 kept
        ("mis", "token", 2.0, 0.6, 0.0, 1.0),  # both outside [0.6, 2]
        ("tis", "sequence", 2.0, None, -1.5, 0.0),  # one weight 3 * 0.5 = 1.5 <= 2
        ("tis", "sequence", 1.2, None, -1.2, 1.0),  # truncated to 1.2
        ("mis", "sequence", 1.2, None, 0.0, 1.0),  # 1.5 > 1.2: the sequence is dropped
    ],
)
def test_truncated_and_masked_importance_sampling(
    correction: str, level: str, is_max: float, is_min: float | None, expected: float, fraction
) -> None:
    opts = GRPOOptions(
        behaviour_policy="recomputed",
        off_policy_correction=correction,
        correction_level=level,
        is_max=is_max,
        is_min=is_min,
        loss_agg="token_mean",
    )
    logprobs = leaf([[0.0, 0.0]])
    loss, m = PolicyGradient(opts).loss(behaviour_batch(), logprobs)
    assert loss.item() == pytest.approx(expected)
    key = "is_truncated_fraction" if correction == "tis" else "is_masked_fraction"
    assert m[key] == pytest.approx(fraction)
    assert m["is_weight/max"] == pytest.approx(3.0 if level == "token" else 1.5)


def test_behaviour_policy_choice() -> None:
    # rollout log-probs -1, recomputed 0, current 0: ratio 1 against recomputed, e against rollout
    b = batch([[1]], [[1.0]], rollout=[[-1.0]], old_logprobs=t([[0.0]]))
    lp = t([[0.0]])
    high = {"clip_eps_high": 5.0}  # keep e inside the clip range
    _, rec = PolicyGradient(GRPOOptions(behaviour_policy="recomputed", **high)).loss(b, lp)
    _, rol = PolicyGradient(GRPOOptions(behaviour_policy="rollout", **high)).loss(b, lp)
    _, auto = PolicyGradient(GRPOOptions(**high)).loss(b, lp)
    assert rec["ratio/mean"] == 1.0 and auto["ratio/mean"] == 1.0
    assert rol["ratio/mean"] == pytest.approx(math.e)
    b.old_logprobs = None
    _, auto = PolicyGradient(GRPOOptions(**high)).loss(b, lp)
    assert auto["ratio/mean"] == pytest.approx(math.e)  # falls back to the engine's
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyGradient(GRPOOptions(behaviour_policy="recomputed")).loss(b, lp)


def test_mismatch_metrics() -> None:
    # old - rollout = (0.5, 0) -> |d| mean 0.25, max 0.5;
    # KL(rollout || train) k3 = mean(e^d - 1 - d) = (e^0.5 - 1.5 + 0) / 2 = 0.0743606
    b = batch([[1, 1, 0]], [[0, 0, 0]], rollout=[[-1.5, -2.0, -9.0]])
    b.old_logprobs = t([[-1.0, -2.0, 0.0]])
    _, m = PolicyGradient(GRPOOptions()).loss(b, t([[-1.0, -2.0, 0.0]]))
    assert m["mismatch/abs_mean"] == pytest.approx(0.25)
    assert m["mismatch/abs_max"] == pytest.approx(0.5)
    assert m["mismatch/kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    # Without old_logprobs the current log-probs stand for the trainer.
    b.old_logprobs = None
    _, m = PolicyGradient(GRPOOptions()).loss(b, t([[-1.0, -1.0, 0.0]]))
    assert m["mismatch/abs_max"] == pytest.approx(1.0)


def test_ppo_value_loss_with_clipping() -> None:
    # old values (0.5, 0.5), returns (2, 0), new values (1.0, 0.6), value_clip 0.2:
    #   token 0: (1 - 2)^2 = 1; clipped 0.5 + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69 -> 0.5*1.69 = 0.845
    #            (the clipped branch binds: no gradient)
    #   token 1: (0.6 - 0)^2 = 0.36; inside the clip range -> 0.5 * 0.36 = 0.18,
    #            gradient 0.5 * 2 * 0.6 = 0.6, / 2 tokens * value_coef 0.5 = 0.15
    # value loss = (0.845 + 0.18) / 2 = 0.5125; total = 0 (zero advantages) + 0.5 * 0.5125
    b = batch([[1, 1]], [[0.0, 0.0]], values=t([[0.5, 0.5]]))
    b.returns = t([[2.0, 0.0]])
    opts = PPOOptions(critic=CriticOptions(value_coef=0.5, value_clip=0.2))
    values = leaf([[1.0, 0.6]])
    loss, m = PolicyGradient(opts).loss(b, t([[0.0, 0.0]]), values=values)
    assert loss.item() == pytest.approx(0.25625)
    assert m["loss/value"] == pytest.approx(0.5125)
    assert m["value_clip_fraction"] == 0.5
    # R - V = (1, -0.6): variance 0.64 (mean 0.2); Var(R) = 1 (mean 1): 1 - 0.64 / 1 = 0.36
    assert m["explained_variance"] == pytest.approx(0.36)
    assert m["values/mean"] == pytest.approx(0.8) and m["returns/max"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(values.grad, t([[0.0, 0.15]]))
    with pytest.raises(ValueError, match="values="):
        PolicyGradient(opts).loss(b, t([[0.0, 0.0]]))


def test_explained_variance() -> None:
    mask = t([[1, 1, 1, 0]])
    returns = t([[1.0, 2.0, 3.0, 99.0]])  # the masked 99 counts nowhere
    assert explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    # The mean of the returns explains nothing: 0.
    assert explained_variance(t([[2.0, 2.0, 2.0, 0.0]]), returns, mask) == pytest.approx(0.0)
    # V = (3, 2, 1): R - V = (-2, 0, 2), variance 8/3; Var(R) = 2/3: 1 - 4 = -3
    assert explained_variance(t([[3.0, 2.0, 1.0, 0.0]]), returns, mask) == pytest.approx(-3.0)
    # Constant returns: nothing to explain.
    assert explained_variance(t([[0.0, 1.0, 2.0, 0.0]]), t([[1.0, 1.0, 1.0, 0.0]]), mask) == 0.0


def test_on_policy_distillation() -> None:
    # student (0.5, 0.2), teacher (0.25, 0.2): d = (ln 2, 0); loss = mean d = ln 2 / 2 = 0.346574
    # gradient = d / 2 tokens = (0.346574, 0)
    logprobs = leaf([[LN(0.5), LN(0.2)]])
    b = batch([[1, 1]], None, rollout=[[LN(0.5), LN(0.2)]])
    b.teacher_logprobs = t([[LN(0.25), LN(0.2)]])
    algo = OnPolicyDistillation(DistillationOptions())
    algo.compute_advantages(b)
    torch.testing.assert_close(b.advantages, t([[-LN(2), 0.0]]))
    loss, m = algo.loss(b, logprobs)
    assert loss.item() == pytest.approx(LN(2) / 2)
    assert m["reverse_kl"] == pytest.approx(LN(2) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[LN(2) / 2, 0.0]]))


def test_on_policy_distillation_weighs_stale_samples() -> None:
    # The policy now gives the tokens 0.5 and 0.2; an older one sampled them at 0.25 and 0.2:
    # w = (2, 1). d = (ln 2, ln 2) against a teacher at (0.25, 0.1). Gradient w d / 2.
    logprobs = leaf([[LN(0.5), LN(0.2)]])
    b = batch([[1, 1]], None, rollout=[[LN(0.25), LN(0.2)]])
    b.teacher_logprobs = t([[LN(0.25), LN(0.1)]])
    loss, m = OnPolicyDistillation(DistillationOptions()).loss(b, logprobs)
    assert loss.item() == pytest.approx(3 * LN(2) / 2)
    assert m["reverse_kl"] == pytest.approx(LN(2))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[LN(2), LN(2) / 2]]))
    # Truncated at 1.5: the first token weighs 1.5 and counts as truncated.
    logprobs = leaf([[LN(0.5), LN(0.2)]])
    loss, m = OnPolicyDistillation(DistillationOptions(is_max=1.5)).loss(b, logprobs)
    assert loss.item() == pytest.approx(2.5 * LN(2) / 2)
    assert m["is_truncated_fraction"] == pytest.approx(0.5)
    # No weight: the samples are taken as the current policy's.
    logprobs = leaf([[LN(0.5), LN(0.2)]])
    loss, _ = OnPolicyDistillation(DistillationOptions(is_max=None)).loss(b, logprobs)
    assert loss.item() == pytest.approx(LN(2))


def test_sft() -> None:
    # NLL of the 2 loss tokens: (1 + 2) / 2 = 1.5; gradient -1/2 on each loss token
    logprobs = leaf([[-1.0, -2.0, -3.0]])
    b = batch([[1, 1, 0]], None, rollout=[[-1.0, -2.0, -3.0]])
    algo = SFT(SFTOptions())
    algo.compute_advantages(b)
    loss, m = algo.loss(b, logprobs)
    assert loss.item() == pytest.approx(1.5) and m["nll"] == pytest.approx(1.5)
    assert m["mismatch/abs_max"] == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-0.5, -0.5, 0.0]]))


def test_sft_on_conversations_from_data_reports_no_mismatch() -> None:
    # Samples rendered from data carry no engine log-probs (0.0): same loss, no mismatch
    # metrics (they would only repeat the NLL).
    logprobs = leaf([[-1.0, -2.0, -3.0]])
    b = batch([[1, 1, 0]], None, rollout=[[0.0, 0.0, 0.0]])
    algo = SFT(SFTOptions())
    algo.compute_advantages(b)
    loss, m = algo.loss(b, logprobs)
    assert loss.item() == pytest.approx(1.5) and m["nll"] == pytest.approx(1.5)
    assert not [k for k in m if k.startswith("mismatch/")]


def test_missing_inputs_are_named() -> None:
    b = batch([[1]], [[1.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        PolicyGradient(GRPOOptions(kl_coef=0.1)).loss(b, t([[0.0]]))
    with pytest.raises(ValueError, match="entropy"):
        PolicyGradient(GRPOOptions(entropy_coef=0.1)).loss(b, t([[0.0]]))
    b.advantages = None
    with pytest.raises(ValueError, match="compute_advantages"):
        PolicyGradient(GRPOOptions()).loss(b, t([[0.0]]))
