"""Properties that must hold for any input (hypothesis)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_algorithms import advantages as est
from miles_algorithms.algorithms import PolicyGradient
from miles_algorithms.options import GRPOOptions
from miles_algorithms.policy_loss import clipped_surrogate, importance_ratio

from miles_core.contracts import TokenBatch

D = torch.float64
FAST = settings(max_examples=60, deadline=None, database=None)
reward = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of 1-4 groups of 1-5 samples, with shuffled arbitrary group labels."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    labels = draw(
        st.lists(st.integers(-50, 50), min_size=len(sizes), max_size=len(sizes), unique=True)
    )
    rewards, groups = [], []
    for label, size in zip(labels, sizes, strict=True):
        for _ in range(size):
            rewards.append(draw(reward))
            groups.append(label)
    perm = draw(st.permutations(range(len(rewards))))
    return (
        torch.tensor([rewards[i] for i in perm], dtype=D),
        torch.tensor([groups[i] for i in perm]),
    )


@FAST
@given(grouped_rewards(), st.sampled_from(["group", "batch", "none"]), st.booleans())
def test_advantages_are_zero_mean_within_each_group(data, scale, unbiased) -> None:
    rewards, groups = data
    adv = est.grpo(
        rewards, groups, torch.ones(len(rewards), 1, dtype=D), scale=scale, unbiased=unbiased
    )[:, 0]
    for g in groups.unique():
        sel = adv[groups == g]
        assert abs(float(sel.sum())) <= 1e-6 * max(1.0, float(sel.abs().max()))


@FAST
@given(
    grouped_rewards(),
    st.floats(-5, 5, width=32),
    st.integers(2, 5),
    st.integers(1, 6),
    st.sampled_from(["token_mean", "seq_mean_token_mean", "constant"]),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from([("group", 0.0), ("group", 1e-6), ("batch", 0.0), ("none", 0.0)]),
    st.integers(0, 2**31 - 1),
)
def test_zero_variance_group_has_zero_advantage_and_zero_gradient(
    data, constant, size, width, agg, level, scale_eps, seed
) -> None:
    rewards, groups = data
    # Append a group whose rewards are all equal.
    rewards = torch.cat([rewards, torch.full((size,), constant, dtype=D)])
    groups = torch.cat([groups, torch.full((size,), 999)])
    n = len(rewards)
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, width, generator=gen) < 0.8).to(D)
    b = TokenBatch(
        response_mask=mask,
        rollout_logprobs=-torch.rand(n, width, generator=gen, dtype=D),
        rewards=rewards,
        group_index=groups,
    )
    scale, eps = scale_eps
    opts = GRPOOptions(
        loss_agg=agg,
        ratio_level=level,
        behaviour_policy="rollout",
        scale_rewards=scale,
        std_eps=eps,
    )
    algo = PolicyGradient(opts)
    algo.compute_advantages(b)
    flat = groups == 999
    assert torch.equal(b.advantages[flat], torch.zeros(size, width, dtype=D))
    assert torch.isfinite(b.advantages).all()
    logprobs = b.rollout_logprobs + 0.3 * torch.randn(n, width, generator=gen, dtype=D)
    logprobs.requires_grad_(True)
    loss, _ = algo.loss(b, logprobs)
    loss.backward()
    assert torch.equal(logprobs.grad[flat], torch.zeros(size, width, dtype=D))


@FAST
@given(
    st.lists(st.floats(-3, 3, width=32), min_size=1, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_sequence_ratio_is_the_geometric_mean_of_token_ratios(log_ratios, keep) -> None:
    n = len(log_ratios)
    keep = [True, *keep[1:n]]  # at least one trained token
    lp = torch.tensor([log_ratios], dtype=D)
    mask = torch.tensor([keep], dtype=D)
    s = importance_ratio(lp, torch.zeros_like(lp), mask, "sequence")
    token = [math.exp(x) for x, k in zip(log_ratios, keep, strict=True) if k]
    geometric = math.prod(token) ** (1 / len(token))
    assert math.isclose(float(s), geometric, rel_tol=1e-9)


@FAST
@given(
    st.floats(-5, 5, width=32),
    st.floats(-4, 4, width=32),
    st.floats(0, 0.9),
    st.floats(0, 2),
    st.one_of(st.none(), st.floats(1.01, 10)),
)
def test_clipping_bounds(log_r, adv, eps_low, eps_high, c) -> None:
    r = torch.tensor([math.exp(log_r)], dtype=D, requires_grad=True)
    a = torch.tensor([adv], dtype=D)
    pg = clipped_surrogate(r, a, eps_low, eps_high, c)
    pgv, rv = float(pg.detach()), float(r.detach())
    objective = -pgv
    # The objective never credits a ratio beyond the clip range in the advantage's direction.
    if adv > 0:
        assert objective <= adv * (1 + eps_high) + 1e-9
    if adv < 0:
        assert objective <= adv * (1 - eps_low) + 1e-9
        if c is not None:  # dual clip: a negative-advantage token's loss is at most c |A|
            assert pgv <= -adv * c + 1e-9
    # Without dual clip it is pessimistic: never above the unclipped objective. (Dual clip
    # deliberately gives up pessimism for negative advantages with a huge ratio.)
    if c is None:
        assert objective <= adv * rv + 1e-9
    # No gradient flows once the ratio has left the range in the advantage's direction.
    pg.sum().backward()
    if (adv > 0 and rv > 1 + eps_high) or (adv < 0 and rv < 1 - eps_low):
        assert float(r.grad) == 0.0
