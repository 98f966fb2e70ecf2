"""RLOO, a Miles algorithm plugin in one module: REINFORCE with a leave-one-out baseline.

Each sample's advantage is its reward minus the mean reward of the *other* samples of its
group, so it is unbiased without a critic; the loss is the policy gradient ``-A * log pi``
averaged over the response tokens. It is on-policy (no importance ratio), so it needs no input
beyond what every rollout carries, and it reports its own metrics under ``rloo/``.

Only ``miles_core``'s public API is used: the ``Algorithm`` record, ``hookimpl`` and the
``TokenBatch`` the trainer backend hands the algorithm. Importing the module imports no torch:
the factory is given as a ``"module:attr"`` string and torch is imported when a run builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from miles_core import Algorithm, hookimpl

if TYPE_CHECKING:
    from torch import Tensor

    from miles_core.contracts import TokenBatch


class RLOOOptions(BaseModel):
    """The options of ``algorithm: {name: rloo, ...}`` in a run config."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error naming it

    coef: float = Field(1.0, gt=0, description="scale of the policy-gradient loss")
    normalize: bool = Field(
        False, description="divide the advantages by their standard deviation over the batch"
    )


class RLOO:
    """The working algorithm (``miles_core.contracts.AlgorithmImpl``)."""

    #: on-policy: the loop computes no reference, behaviour or critic log-probs for it
    needs: frozenset[str] = frozenset()

    def __init__(self, options: RLOOOptions) -> None:
        self.options = options

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Fill ``batch.advantages`` [B, T]: each sample's leave-one-out advantage on its
        response tokens (0 for a sample alone in its group: it has no baseline)."""
        import torch

        with torch.no_grad():
            rewards = batch.rewards.to(batch.rollout_logprobs.dtype)
            groups = batch.group_index.long()
            n = int(groups.max()) + 1 if groups.numel() else 0
            sums = torch.zeros(n, dtype=rewards.dtype).index_add_(0, groups, rewards)
            sizes = torch.zeros(n, dtype=rewards.dtype).index_add_(
                0, groups, torch.ones_like(rewards)
            )
            others = sizes[groups] - 1
            baseline = (sums[groups] - rewards) / others.clamp(min=1)
            advantages = torch.where(others > 0, rewards - baseline, torch.zeros_like(rewards))
            if self.options.normalize and advantages.numel() > 1:
                advantages = advantages / (advantages.std() + 1e-6)
            mask = batch.response_mask.to(rewards.dtype)
            batch.advantages = advantages[:, None] * mask

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """``-coef * mean(A * log pi)`` over the response tokens, with its metrics."""
        import torch

        assert batch.advantages is not None, "compute_advantages runs before loss"
        mask = batch.response_mask.to(logprobs.dtype)
        advantages = batch.advantages.to(logprobs.dtype)
        tokens = mask.sum().clamp(min=1)
        loss = -self.options.coef * (advantages * logprobs * mask).sum() / tokens
        with torch.no_grad():
            per_sample = advantages.sum(-1) / mask.sum(-1).clamp(min=1)
            metrics = {
                "loss": float(loss),
                "rloo/advantage_abs_mean": float(per_sample.abs().mean()),
                "rloo/reward_mean": float(batch.rewards.float().mean()),
            }
            if entropy is not None:
                metrics["rloo/entropy"] = float((entropy.detach() * mask).sum() / tokens)
        return loss, metrics


def build(options: RLOOOptions) -> RLOO:
    """The record's factory: called with the validated options when a run builds it."""
    return RLOO(options)


@hookimpl
def miles_register_algorithms(register: Callable[[Algorithm], None]) -> None:
    """Register ``rloo`` with Miles."""
    register(
        Algorithm(
            name="rloo",
            factory="miles_thirdparty_algo:build",
            config=RLOOOptions,
            description="REINFORCE with a leave-one-out baseline (on-policy, no critic)",
        )
    )
