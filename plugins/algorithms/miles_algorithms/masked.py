"""Masked reductions over padded ``[B, T]`` tensors, the loss aggregations and KL estimators."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is 1 (over all elements, or along ``dim``)."""
    if dim is None:
        return (x * mask).sum()
    return (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` where ``mask`` is 1; an empty mask gives 0, not NaN."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """``(x - mean) / (std + eps)`` over the masked elements (population std); 0 where unmasked."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str, max_response_length: int | None = None
) -> Tensor:
    """Reduce per-token terms ``[B, T]`` (or per-sequence ``[B, 1]``) to a scalar.

    ``token_mean``: every loss token weighs the same. ``seq_mean_token_mean``: every sequence
    weighs the same (mean over all B rows, an empty row counting 0, as TRL's ``grpo``).
    ``constant``: sum / (B * max_response_length), Dr. GRPO's length-unbiased normaliser.
    """
    per_token = per_token.expand_as(mask)
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=-1).mean()
    if mode == "constant":
        length = max_response_length or mask.shape[-1]
        return masked_sum(per_token, mask) / (mask.shape[0] * length)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; allowed: token_mean, seq_mean_token_mean, constant"
    )


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``d = log pi - log pi_ref``: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1.
    """
    d = logprobs - ref_logprobs
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        # Written as TRL writes it, so the two agree to the last bit.
        return torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1
    raise ValueError(f"unknown kl_type {kl_type!r}; allowed: k1, k2, k3")


def group_ids(group_index: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group labels ``[B]`` to ``0..G-1``; returns (ids, G)."""
    uniq, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, int(uniq.numel())


def group_mean_baseline(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """``(rewards - group mean, constant)`` where ``constant`` flags samples whose group has
    zero reward variance (all equal): their centred reward is set to exactly 0 so rounding in
    the mean can never give a group without signal a gradient."""
    ids, n = group_ids(group_index)
    sums = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, ids, rewards)
    counts = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, ids, torch.ones_like(rewards)
    )
    mean = (sums / counts)[ids]
    gmax = torch.full((n,), -torch.inf, dtype=rewards.dtype, device=rewards.device)
    gmin = torch.full((n,), torch.inf, dtype=rewards.dtype, device=rewards.device)
    gmax = gmax.scatter_reduce(0, ids, rewards, reduce="amax")
    gmin = gmin.scatter_reduce(0, ids, rewards, reduce="amin")
    constant = (gmax == gmin)[ids]
    centred = torch.where(constant, torch.zeros_like(rewards), rewards - mean)
    return centred, constant


def group_std(rewards: Tensor, group_index: Tensor, unbiased: bool) -> Tensor:
    """Standard deviation of each sample's group ``[B]`` (0 for a group of one)."""
    ids, n = group_ids(group_index)
    ones = torch.ones_like(rewards)
    counts = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, ids, ones)
    sums = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, ids, rewards)
    mean = sums / counts
    sq = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, ids, (rewards - mean[ids]) ** 2
    )
    denom = (counts - 1).clamp(min=1) if unbiased else counts
    return (sq / denom).sqrt()[ids]
