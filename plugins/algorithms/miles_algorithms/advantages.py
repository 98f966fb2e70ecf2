"""Advantage estimators: pure functions of rewards, group labels, masks and (for PPO) values.

Every function takes padded ``[B, T]`` tensors with a 0/1 ``mask`` and returns ``[B, T]``
advantages that are 0 wherever the mask is 0. A sequence's scalar reward is placed on its last
loss token when a token-level return is needed. Loss-masked tokens inside a response (a tool's
output in a multi-turn trajectory) are skipped: returns and GAE flow past them unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_algorithms.masked import group_mean_baseline, group_std, masked_whiten


def grpo(
    rewards: Tensor,
    group_index: Tensor,
    mask: Tensor,
    *,
    scale: str = "group",
    unbiased: bool = True,
    eps: float = 1e-6,
    turn_rewards: Tensor | None = None,
) -> Tensor:
    """GRPO / Dr. GRPO advantages: ``(r - mean_group(r)) / (std + eps)`` on every token.

    ``scale``: ``'group'`` divides by the group's std, ``'batch'`` by the std of all rewards,
    ``'none'`` not at all (Dr. GRPO). A group whose rewards are all equal gets exactly 0.

    With ``turn_rewards`` ``[B, T]`` (each turn's reward on its last token): the per-turn
    advantage. A token's return is the episode's reward plus the turn rewards from its turn on
    (``G_t``); it is centred on, and scaled by, its group's statistics of the whole episode's
    return ``G_0`` (the same as without turn rewards when they are all 0).
    """
    totals = rewards if turn_rewards is None else rewards + turn_rewards.sum(-1)
    centred, _ = group_mean_baseline(totals, group_index)
    if turn_rewards is None:
        tokens = centred.unsqueeze(-1).expand_as(mask)
    else:  # G_t minus the group's mean of G_0
        to_go = turn_rewards.flip(-1).cumsum(-1).flip(-1)
        tokens = to_go - turn_rewards.sum(-1, keepdim=True) + centred.unsqueeze(-1)
    if scale == "group":
        std = group_std(totals, group_index, unbiased)
    elif scale == "batch":
        if totals.numel() > 1:
            std = totals.std(correction=1 if unbiased else 0).expand_as(totals)
        else:
            std = torch.zeros_like(totals)
    elif scale == "none":
        return tokens * mask
    else:
        raise ValueError(f"unknown scale {scale!r}; allowed: group, batch, none")
    denom = std + eps
    # A zero std means the centred rewards are exactly 0 already: divide by 1, not by 0.
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return tokens / denom.unsqueeze(-1) * mask


def last_token_index(mask: Tensor) -> Tensor:
    """Index of each row's last loss token ``[B]`` (0 for an empty row)."""
    width = mask.shape[-1]
    positions = torch.arange(width, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(-1)


def token_rewards(
    rewards: Tensor,
    mask: Tensor,
    kl_penalty: Tensor | None = None,
    turn_rewards: Tensor | None = None,
) -> Tensor:
    """Per-token rewards ``[B, T]``: the scalar reward on the last loss token (plus each
    turn's reward on the turn's last token, given ``turn_rewards``), minus the (already
    weighted) per-token KL penalty on every loss token."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    if turn_rewards is not None:
        out = out + turn_rewards.to(rewards.dtype)
    has_tokens = mask.sum(-1) > 0
    out[torch.arange(mask.shape[0], device=mask.device), last_token_index(mask)] += torch.where(
        has_tokens, rewards, torch.zeros_like(rewards)
    )
    if kl_penalty is not None:
        out = out - kl_penalty * mask
    return out * mask


def discounted_returns(rewards_t: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_next`` over loss tokens, right to left."""
    out = torch.zeros_like(rewards_t)
    running = torch.zeros_like(rewards_t[:, 0])
    for t in range(rewards_t.shape[-1] - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, rewards_t[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def reinforce_pp(
    rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    kl_penalty: Tensor | None = None,
    eps: float = 1e-8,
    group_index: Tensor | None = None,
    turn_rewards: Tensor | None = None,
) -> Tensor:
    """REINFORCE++: discounted token-level returns of the KL-shaped rewards (each turn's
    reward on its last token too, given ``turn_rewards``), whitened over all loss tokens of
    the batch. Given ``group_index`` (the baseline variant), each episode reward first has its
    group's mean subtracted."""
    if group_index is not None:
        rewards, _ = group_mean_baseline(rewards, group_index)
    shaped = token_rewards(rewards, mask, kl_penalty, turn_rewards)
    returns = discounted_returns(shaped, mask, gamma)
    return masked_whiten(returns, mask, eps)


def gae(
    rewards_t: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next loss token (0 past the end), and ``returns = A + V``.
    """
    adv = torch.zeros_like(rewards_t)
    next_value = torch.zeros_like(rewards_t[:, 0])
    next_adv = torch.zeros_like(rewards_t[:, 0])
    for t in range(rewards_t.shape[-1] - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards_t[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    return adv, (adv + values) * mask
