"""One stochastic DDIM step as a Gaussian, and its log-probability.

With ``eta > 0`` the DDIM update (Song et al., eq. 12) is ``x_{t-1} = mu + sigma * z`` with
``z ~ N(0, I)``: a Gaussian policy over the next latent whose mean depends on the network. The
formulas follow ``diffusers.DDIMScheduler.step`` exactly (a test checks the two agree on the
same noise), but return the mean and standard deviation instead of only a sample, so the
log-probability of a stored step can be recomputed under new weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepCoefficients:
    """Schedule constants of one step ``t -> prev_t`` (plain floats: shared by the batch)."""

    alpha_prod_t: float
    alpha_prod_prev: float
    std: float  # sigma_t(eta)


def step_coefficients(
    alphas_cumprod: Tensor, final_alpha_cumprod: float, t: int, prev_t: int, eta: float
) -> StepCoefficients:
    """The constants of the step from timestep ``t`` to ``prev_t`` (``prev_t < 0``: the end)."""
    a_t = float(alphas_cumprod[t])
    a_prev = float(alphas_cumprod[prev_t]) if prev_t >= 0 else float(final_alpha_cumprod)
    variance = (1.0 - a_prev) / (1.0 - a_t) * (1.0 - a_t / a_prev)
    return StepCoefficients(a_t, a_prev, eta * math.sqrt(max(variance, 0.0)))


def step_mean(
    sample: Tensor, eps: Tensor, coef: StepCoefficients, *, clip_sample: bool = False
) -> Tensor:
    """Mean of ``x_{t-1}`` given ``x_t`` (``sample``) and the predicted noise ``eps``."""
    x0 = (sample - math.sqrt(1.0 - coef.alpha_prod_t) * eps) / math.sqrt(coef.alpha_prod_t)
    if clip_sample:
        x0 = x0.clamp(-1.0, 1.0)
    direction = math.sqrt(max(1.0 - coef.alpha_prod_prev - coef.std**2, 0.0)) * eps
    return math.sqrt(coef.alpha_prod_prev) * x0 + direction


def gaussian_logprob(x: Tensor, mean: Tensor, std: float, *, reduction: str = "sum") -> Tensor:
    """Log-density of ``x`` under ``N(mean, std^2 I)``, reduced over all but the first dim.

    ``reduction="sum"`` is the exact log-density; ``"mean"`` divides it by the number of
    dimensions (the per-dimension log-probability DDPO and Flow-GRPO train on).
    """
    if std <= 0.0:
        raise ValueError("a step with std 0 is deterministic and has no log-probability")
    lp = -((x - mean) ** 2) / (2.0 * std**2) - math.log(std) - 0.5 * math.log(2.0 * math.pi)
    dims = tuple(range(1, lp.ndim))
    if reduction == "sum":
        return lp.sum(dim=dims)
    if reduction == "mean":
        return lp.mean(dim=dims)
    raise ValueError(f"reduction {reduction!r} is not 'sum' or 'mean'")


def sample_step(
    mean: Tensor, std: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Draw ``x_{t-1} = mean + std * z``; returns the sample and the noise ``z``."""
    z = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + std * z, z
