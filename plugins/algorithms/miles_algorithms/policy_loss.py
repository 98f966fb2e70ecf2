"""The pieces of the clipped policy loss: importance ratios, the clipped surrogate and the
off-policy importance weight. Pure tensor functions; :mod:`miles_algorithms.algorithms`
assembles them."""

from __future__ import annotations

import torch
from torch import Tensor

from miles_algorithms.masked import masked_mean


def importance_ratio(
    logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str = "token"
) -> Tensor:
    """``pi_theta / pi_behaviour``: per token ``[B, T]``, or per sequence ``[B, 1]`` as the
    exponential of the mean token log-ratio, i.e. the geometric mean of the token ratios
    (GSPO's length-normalised sequence ratio)."""
    log_ratio = logprobs - behaviour_logprobs
    if level == "sequence":
        return torch.exp(masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1))
    if level != "token":
        raise ValueError(f"unknown ratio level {level!r}; allowed: token, sequence")
    return torch.exp(log_ratio)


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> Tensor:
    """Per-token PPO loss ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; with
    ``dual_clip_c`` the loss of a negative-advantage token is further bounded by ``-A c``
    (dual clip), so a huge ratio on a bad token cannot blow up the update."""
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps_low, 1 + eps_high))
    if dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip_c), pg)
    return pg


def importance_weight(
    recomputed_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str = "token",
    high: float = 2.0,
    low: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Off-policy weight ``pi_recomputed / pi_rollout`` (detached): per token ``[B, T]`` or per
    sequence ``[B, 1]`` (the product over the sequence's tokens).

    ``tis`` truncates it into ``[low, high]``; ``mis`` keeps it where it lies in
    ``[low, high]`` and zeroes the token (or sequence) elsewhere. Returns (weight, raw weight,
    flags of the truncated or masked units).
    """
    d = (recomputed_logprobs.detach() - rollout_logprobs.detach()) * mask
    if level == "sequence":
        d = d.sum(-1, keepdim=True)
    raw = torch.exp(d)
    floor = low if low is not None else 0.0
    outside = (raw > high) | (raw < floor)
    if mode == "tis":
        return raw.clamp(min=low, max=high), raw, outside
    if mode == "mis":
        return torch.where(outside, torch.zeros_like(raw), raw), raw, outside
    raise ValueError(f"unknown off-policy correction {mode!r}; allowed: tis, mis")
