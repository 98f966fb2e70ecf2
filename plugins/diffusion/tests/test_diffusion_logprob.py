"""The sampler's per-step Gaussian log-probabilities: their formula, their agreement with
diffusers' DDIM step, and their recomputation under the current weights."""

from __future__ import annotations

import math

import pytest
import torch
from miles_diffusion.ddim import gaussian_logprob, step_coefficients, step_mean
from miles_diffusion.options import DiffusionOptions
from miles_diffusion.policy import DiffusionPolicy
from pydantic import ValidationError

torch.set_num_threads(1)


def test_gaussian_logprob_matches_torch_distributions() -> None:
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(5, 3, 4, 4, generator=gen, dtype=torch.float64)
    x = mean + 0.3 * torch.randn(5, 3, 4, 4, generator=gen, dtype=torch.float64)
    want = torch.distributions.Normal(mean, 0.3).log_prob(x)
    got_sum = gaussian_logprob(x, mean, 0.3, reduction="sum")
    got_mean = gaussian_logprob(x, mean, 0.3, reduction="mean")
    torch.testing.assert_close(got_sum, want.sum(dim=(1, 2, 3)), rtol=0, atol=1e-10)
    torch.testing.assert_close(got_mean, want.mean(dim=(1, 2, 3)), rtol=0, atol=1e-12)


def test_gaussian_logprob_by_hand() -> None:
    # One dimension: log N(1.5; 1, 0.5^2) = -0.5 * 1^2 - log 0.5 - 0.5 log(2 pi).
    got = gaussian_logprob(torch.tensor([[1.5]]), torch.tensor([[1.0]]), 0.5)
    want = -0.5 - math.log(0.5) - 0.5 * math.log(2 * math.pi)
    assert got.item() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="std 0"):
        gaussian_logprob(torch.zeros(1, 1), torch.zeros(1, 1), 0.0)


@pytest.mark.parametrize("eta", [0.3, 1.0])
@pytest.mark.parametrize("clip_sample", [False, True])
@pytest.mark.parametrize("spacing", ["trailing", "leading"])
def test_step_matches_diffusers_ddim(eta: float, clip_sample: bool, spacing: str) -> None:
    """mean + std * z equals DDIMScheduler.step on the same noise z, at every step."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(
        beta_schedule="linear",
        timestep_spacing=spacing,
        set_alpha_to_one=False,
        clip_sample=clip_sample,
    )
    sched.set_timesteps(8)
    stride = sched.config.num_train_timesteps // 8
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    for t in sched.timesteps.tolist():
        eps = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        z = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        coef = step_coefficients(
            sched.alphas_cumprod, float(sched.final_alpha_cumprod), t, t - stride, eta
        )
        mine = step_mean(x, eps, coef, clip_sample=clip_sample) + coef.std * z
        theirs = sched.step(eps, t, x, eta=eta, variance_noise=z).prev_sample
        # diffusers keeps its schedule constants in float32: agreement to float32 rounding.
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        x = theirs


def _policy(**kw: object) -> DiffusionPolicy:
    return DiffusionPolicy(DiffusionOptions(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"logprob_reduction": "sum"},
        {"guidance_scale": 3.0, "eta": 0.5},
        {"num_classes": 0, "clip_sample": True},
    ],
    ids=["mean", "sum", "guidance", "unconditional"],
)
def test_recomputed_logprobs_equal_sampled(options: dict[str, object]) -> None:
    policy = _policy(**options)
    labels = [0, 1, 2, 3, 0, 1] if policy.options.num_classes else [0] * 6
    r = policy.sample(labels, seed=7)
    k = policy.num_steps
    assert r.latents.shape == (6, k + 1, 3, 8, 8)
    assert r.logprobs.shape == (6, k)
    assert r.timesteps.shape == (k,)
    assert torch.isfinite(r.logprobs).all()
    with torch.no_grad():
        again = policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], r.timesteps, r.labels)
    torch.testing.assert_close(again, r.logprobs, rtol=0, atol=1e-5)
    # Per-sample timesteps [B, K] are accepted too.
    with torch.no_grad():
        per_sample = r.timesteps.expand(6, k)
        again2 = policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], per_sample, r.labels)
    torch.testing.assert_close(again2, r.logprobs, rtol=0, atol=1e-5)


def test_sampled_step_logprob_is_the_gaussian_of_that_step() -> None:
    """Each recorded log-prob is log N(x_{t-1}; mu_theta(x_t), sigma_t^2) per dimension."""
    policy = _policy()
    r = policy.sample([2, 3], seed=3)
    with torch.no_grad():
        for k, t in enumerate(policy.timesteps):
            coef = policy.coefficients[k]
            eps = policy.predict_noise(r.latents[:, k], t, r.labels)
            mean = step_mean(r.latents[:, k], eps, coef)
            want = torch.distributions.Normal(mean, coef.std).log_prob(r.latents[:, k + 1])
            torch.testing.assert_close(
                r.logprobs[:, k], want.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-5
            )


def test_recomputed_logprobs_change_with_weights() -> None:
    policy = _policy()
    r = policy.sample([0, 1, 2, 3], seed=0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
        moved = policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], r.timesteps, r.labels)
    assert (moved - r.logprobs).abs().max() > 1e-3


def test_step_logprobs_are_differentiable() -> None:
    policy = _policy(num_inference_steps=3)
    r = policy.sample([0, 1], seed=0)
    lp = policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], r.timesteps, r.labels)
    lp.sum().backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_sampling_is_reproducible_by_seed() -> None:
    policy = _policy(num_inference_steps=4)
    a, b, c = (policy.sample([0, 1], seed=s) for s in (5, 5, 6))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.latents, c.latents)
    assert a.images.min() >= 0 and a.images.max() <= 1
    # The policy's initialisation is fixed by init_seed and leaves the global RNG alone.
    state = torch.random.get_rng_state()
    other = _policy(num_inference_steps=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(other.sample([0, 1], seed=5).latents, a.latents)


def test_float64_policy() -> None:
    policy = _policy(dtype="float64", num_inference_steps=4)
    r = policy.sample([0, 1], seed=0)
    assert r.latents.dtype == torch.float64
    with torch.no_grad():
        again = policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], r.timesteps, r.labels)
    torch.testing.assert_close(again, r.logprobs, rtol=0, atol=1e-10)


def test_bad_inputs_are_refused() -> None:
    policy = _policy(num_inference_steps=4)
    r = policy.sample([0, 1], seed=0)
    with pytest.raises(ValueError, match="not steps of this policy"):
        policy.step_logprobs(r.latents[:, :-1], r.latents[:, 1:], r.timesteps + 1, r.labels)
    with pytest.raises(ValueError, match="labels must be in"):
        policy.sample([0, 9], seed=0)
    with pytest.raises(ValueError, match="class-conditioned"):
        policy.sample(None, seed=0)


def test_zero_variance_schedule_is_refused() -> None:
    # 'leading' spacing ends on timestep 0, whose step to alpha_0 has zero variance.
    with pytest.raises(ValueError, match="zero variance"):
        _policy(timestep_spacing="leading")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"eta": 0.0}, "eta"),
        ({"sample_size": 10, "block_out_channels": (16, 32, 32)}, "divisible by 4"),
        ({"block_out_channels": (12, 32)}, "norm_num_groups"),
        ({"num_classes": 0, "guidance_scale": 2.0}, "class-conditioned"),
        ({"logprob_reduction": "max"}, "logprob_reduction"),
        ({"num_inference_steps": 20, "num_train_timesteps": 10}, "exceeds"),
    ],
)
def test_options_are_validated(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DiffusionOptions(**options)  # type: ignore[arg-type]
