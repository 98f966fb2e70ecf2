"""GRPO over denoising steps (the DDPO / Flow-GRPO objective).

Every denoising step of a trajectory is one "token": its log-probability under the sampling
weights is the behaviour log-prob, the image's group-normalised reward is the advantage of all
its steps, and the loss is the PPO-clipped surrogate of the per-step importance ratio, averaged
over steps and samples. :class:`StepGRPO` is that objective on a
:class:`miles_core.contracts.TokenBatch` whose ``T`` axis is the ``K`` steps, so it implements
the core's backend-blind ``AlgorithmImpl``; :class:`DiffusionGRPOTrainer` drives it on a
:class:`~miles_diffusion.policy.DiffusionPolicy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from miles_core.contracts import TokenBatch
from miles_core.data import Group
from miles_diffusion.options import DiffusionGRPOOptions, StepGRPOOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout
from miles_diffusion.rollout import rollout_from_groups


def group_advantages(
    rewards: Tensor, group_index: Tensor, *, eps: float = 1e-4, clip: float | None = None
) -> Tensor:
    """Normalise rewards within each group: ``(r - mean_g) / (std_g + eps)``, ``[B]``.

    A group whose rewards are all equal gets zero advantages (no learning signal).
    """
    rewards = rewards.to(torch.float64)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        sel = group_index == g
        r = rewards[sel]
        centred = r - r.mean()
        std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        # Equal rewards carry no signal: 0, not 0/0, whatever eps is.
        adv[sel] = centred / (std + eps) if bool(std > 0) else torch.zeros_like(r)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


class StepGRPO:
    """GRPO with a PPO-clipped per-step ratio; implements ``miles_core.contracts.AlgorithmImpl``
    with ``T`` = denoising steps. With ``kl_coef > 0`` the loss adds the per-step KL to the
    reference policy (the k3 estimator), which needs the reference's log-probs."""

    def __init__(self, options: StepGRPOOptions | None = None) -> None:
        self.options = options or StepGRPOOptions()
        #: rollout log-probs and rewards suffice, plus the reference's with a KL term
        self.needs: frozenset[str] = (
            frozenset({"ref_logprobs"}) if self.options.kl_coef > 0 else frozenset()
        )

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Every step of an image gets the image's group-normalised reward."""
        o = self.options
        adv = group_advantages(batch.rewards, batch.group_index, eps=o.adv_eps, clip=o.adv_clip_max)
        mask = batch.response_mask.to(batch.rollout_logprobs.dtype)
        batch.advantages = adv.to(mask.dtype)[:, None] * mask

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Clipped surrogate averaged over the masked steps of ``logprobs`` ``[B, T]``."""
        if batch.advantages is None:
            raise ValueError("call compute_advantages before loss: batch.advantages is None")
        c = self.options.clip_range
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        mask = batch.response_mask.to(logprobs.dtype)
        adv = batch.advantages.to(logprobs.dtype)
        log_ratio = logprobs - old.to(logprobs.dtype).detach()
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - c, 1.0 + c)
        loss = _masked_mean(torch.maximum(unclipped, clipped), mask)
        kl = None
        if self.options.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the reference's log-probs (ref_logprobs)")
            delta = batch.ref_logprobs.to(logprobs.dtype).detach() - logprobs
            kl = _masked_mean(torch.exp(delta) - delta - 1.0, mask)
            loss = loss + self.options.kl_coef * kl
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "clip_fraction": float(
                    _masked_mean(((ratio - 1.0).abs() > c).to(mask.dtype), mask)
                ),
                "approx_kl": float(_masked_mean(0.5 * log_ratio**2, mask)),
                "ratio/mean": float(_masked_mean(ratio, mask)),
            }
            if kl is not None:
                metrics["kl_ref"] = float(kl)
        return loss, metrics


def step_column(batch: TokenBatch, j: int) -> TokenBatch:
    """Step ``j`` of ``batch`` alone (``T`` = 1): what one denoising step's loss reads."""

    def col(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[:, j : j + 1]

    return TokenBatch(
        response_mask=batch.response_mask[:, j : j + 1],
        rollout_logprobs=batch.rollout_logprobs[:, j : j + 1],
        rewards=batch.rewards,
        group_index=batch.group_index,
        old_logprobs=col(batch.old_logprobs),
        ref_logprobs=col(batch.ref_logprobs),
        advantages=col(batch.advantages),
    )


def accumulate_step_losses(
    policy: DiffusionPolicy,
    algorithm: Any,
    batch: TokenBatch,
    rollout: DiffusionRollout,
    compare: Tensor | None = None,
) -> tuple[dict[str, float], float]:
    """Forward and backward of every denoising step of ``rollout``, one step at a time (memory
    does not grow with ``K``), each step's loss divided by ``K``; gradients accumulate in the
    policy's parameters. Returns the loss metrics averaged over steps, and the largest gap
    between the recomputed and the sampled log-probs (the train-rollout mismatch before an
    update) over the rows ``compare`` selects (``[B]`` bools; all rows when ``None``: the
    rows sampled with the weights being trained)."""
    k_steps = policy.step_indices(rollout.timesteps)
    labels = policy.condition(rollout.labels, rollout.latents.shape[0])
    sums: dict[str, float] = {}
    mismatch = 0.0
    for j, k in enumerate(k_steps):
        lp = policy.step_logprob(
            k, rollout.latents[:, j], rollout.latents[:, j + 1], labels, rollout.chunks
        )[:, None]
        gap = (lp.detach() - batch.rollout_logprobs[:, j : j + 1].to(lp.dtype)).abs()
        if compare is not None:
            gap = gap[compare]
        if gap.numel():
            mismatch = max(mismatch, float(gap.max()))
        loss, m = algorithm.loss(step_column(batch, j), lp)
        (loss / len(k_steps)).backward()
        for key, v in m.items():
            sums[key] = sums.get(key, 0.0) + v / len(k_steps)
    return sums, mismatch


class DiffusionGRPOTrainer:
    """Trains a :class:`DiffusionPolicy` with :class:`StepGRPO` on its own rollouts."""

    def __init__(self, policy: DiffusionPolicy, options: DiffusionGRPOOptions | None = None):
        self.policy = policy
        self.options = o = options or DiffusionGRPOOptions()
        self.algorithm = StepGRPO(o)
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=o.learning_rate, weight_decay=o.weight_decay
        )

    def token_batch(
        self, rollout: DiffusionRollout, rewards: Tensor, group_index: Tensor
    ) -> TokenBatch:
        """The rollout as the core's per-token batch: one "token" per denoising step."""
        lp = rollout.logprobs.detach()
        return TokenBatch(
            response_mask=torch.ones_like(lp),
            rollout_logprobs=lp,
            rewards=torch.as_tensor(rewards, dtype=lp.dtype),
            group_index=torch.as_tensor(group_index, dtype=torch.long),
        )

    def train_step(
        self, rollout: DiffusionRollout, rewards: Tensor, group_index: Tensor
    ) -> dict[str, float]:
        """Run ``num_inner_epochs`` optimiser steps on one rollout; bumps the weight version.

        Gradients are accumulated step by step (one denoising step's forward and backward at a
        time), so memory does not grow with ``K``.
        """
        policy, o = self.policy, self.options
        batch = self.token_batch(rollout, rewards, group_index)
        self.algorithm.compute_advantages(batch)
        metrics: dict[str, float] = {}
        mismatch = 0.0
        for epoch in range(o.num_inner_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            sums, gap = accumulate_step_losses(policy, self.algorithm, batch, rollout)
            if epoch == 0:
                # Before any update the trainer's log-probs are the sampler's: the gap is
                # the train-rollout mismatch (0 here, same kernels and weights).
                mismatch = gap
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), o.max_grad_norm)
            self.optimizer.step()
            metrics = {**sums, "grad_norm": float(grad_norm)}
        policy.weight_version += 1
        metrics["mismatch/abs_max"] = mismatch
        metrics["reward/mean"] = float(batch.rewards.mean())
        metrics["weight_version"] = float(policy.weight_version)
        return metrics

    def train_groups(self, groups: Sequence[Group]) -> dict[str, float]:
        """:meth:`train_step` on whole scored groups from the ``diffusion_sample`` rollout
        function (the form the loop hands a trainer)."""
        rollout, rewards, group_index = rollout_from_groups(groups)
        return self.train_step(rollout, rewards, group_index)
