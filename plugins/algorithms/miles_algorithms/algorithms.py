"""The algorithm objects (``miles_core.contracts.AlgorithmImpl``) and their factories.

Each is backend-blind: ``compute_advantages`` fills ``batch.advantages`` (and ``batch.returns``
for PPO) from rewards, group labels and log-probs, and ``loss`` turns the current policy's
log-probs ``[B, T]`` into a scalar loss plus float metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles_algorithms import advantages as est
from miles_algorithms.masked import aggregate, kl_estimate, masked_mean, masked_whiten
from miles_algorithms.options import (
    DistillationOptions,
    GRPOOptions,
    PolicyLossOptions,
    PPOOptions,
    ReinforcePPOptions,
    SFTOptions,
)
from miles_algorithms.policy_loss import clipped_surrogate, importance_ratio, importance_weight

if TYPE_CHECKING:
    from miles_core.contracts import TokenBatch


def _mask(batch: TokenBatch, like: Tensor) -> Tensor:
    return batch.response_mask.to(like.dtype)


def _stats(prefix: str, x: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean, max and min of ``x`` over the masked elements."""
    x = x.expand_as(mask)
    keep = mask > 0
    if not bool(keep.any()):
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    sel = x[keep]
    return {
        f"{prefix}/mean": float(sel.mean()),
        f"{prefix}/max": float(sel.max()),
        f"{prefix}/min": float(sel.min()),
    }


def mismatch_metrics(batch: TokenBatch, logprobs: Tensor) -> dict[str, float]:
    """Train-rollout mismatch: |trainer log-prob - engine log-prob| mean and max, and the k3
    estimate of KL(pi_rollout || pi_train) on the engine's samples.

    The trainer side is ``old_logprobs`` when given (same weights as the engine), else the
    current ``logprobs``.
    """
    with torch.no_grad():
        train = batch.old_logprobs if batch.old_logprobs is not None else logprobs
        train = train.detach()
        m = _mask(batch, train)
        d = train - batch.rollout_logprobs.to(train.dtype)
        abs_d = d.abs() * m
        return {
            "mismatch/abs_mean": float(masked_mean(d.abs(), m)),
            "mismatch/abs_max": float(abs_d.max()) if abs_d.numel() else 0.0,
            "mismatch/kl": float(masked_mean(torch.expm1(d) - d, m)),
        }


def _entropy_metric(entropy: Tensor | None, m: Tensor) -> dict[str, float]:
    if entropy is None:
        return {}
    return {"entropy": float(masked_mean(entropy.detach(), m))}


def _require(value: Tensor | None, what: str, why: str) -> Tensor:
    if value is None:
        raise ValueError(f"{why} needs batch.{what}, which is None; the loop must compute it")
    return value


class PolicyGradient:
    """GRPO, Dr. GRPO, GSPO, PPO and REINFORCE++: an estimator plus the clipped policy loss.

    The estimator is ``options.estimator``; everything else (ratio level, clipping, KL, entropy,
    aggregation, off-policy correction, critic) is read from the same options.
    """

    def __init__(self, options: PolicyLossOptions) -> None:
        self.options = options
        self.estimator: str = getattr(options, "estimator", "grpo")

    @property
    def needs(self) -> frozenset[str]:
        """Exactly the optional batch inputs these options use."""
        o = self.options
        out = set()
        if o.behaviour_policy == "recomputed":
            out.add("old_logprobs")
        if o.kl_coef > 0:
            out.add("ref_logprobs")
        if self.estimator == "gae":
            out.add("values")
        return frozenset(out)

    # --- behaviour policy ----------------------------------------------------------------

    def behaviour_choice(self, batch: TokenBatch) -> str:
        """The resolved behaviour policy: the option, or ``recomputed`` when old_logprobs are
        present and ``rollout`` otherwise."""
        if self.options.behaviour_policy is not None:
            return self.options.behaviour_policy
        return "recomputed" if batch.old_logprobs is not None else "rollout"

    def behaviour_logprobs(self, batch: TokenBatch) -> Tensor:
        """Log-probs of the policy the ratio is taken against (detached)."""
        if self.behaviour_choice(batch) == "recomputed":
            why = "behaviour_policy='recomputed'"
            return _require(batch.old_logprobs, "old_logprobs", why).detach()
        return batch.rollout_logprobs.detach()

    # --- advantages ----------------------------------------------------------------------

    def _kl_penalty(self, batch: TokenBatch, like: Tensor) -> Tensor | None:
        o = self.options
        if o.kl_coef == 0 or o.kl_mode != "reward":
            return None
        ref = _require(batch.ref_logprobs, "ref_logprobs", "kl_mode='reward' with kl_coef > 0")
        return o.kl_coef * kl_estimate(self.behaviour_logprobs(batch), ref, o.kl_type).to(
            like.dtype
        )

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Fill ``batch.advantages`` [B, T] (and ``batch.returns`` for PPO), without grad."""
        o = self.options
        with torch.no_grad():
            rewards = batch.rewards.to(batch.rollout_logprobs.dtype)
            m = _mask(batch, rewards)
            penalty = self._kl_penalty(batch, rewards)
            if isinstance(o, GRPOOptions):
                if penalty is not None:
                    # A sequence-level estimator: the KL penalty shapes the sequence's reward.
                    rewards = rewards - (penalty * m).sum(-1)
                batch.advantages = est.grpo(
                    rewards,
                    batch.group_index,
                    m,
                    scale=o.resolved_scale(),
                    unbiased=o.std_unbiased,
                    eps=o.std_eps,
                    turn_rewards=batch.turn_rewards,
                )
            elif isinstance(o, ReinforcePPOptions):
                batch.advantages = est.reinforce_pp(
                    rewards,
                    m,
                    gamma=o.gamma,
                    kl_penalty=penalty,
                    eps=o.std_eps,
                    group_index=batch.group_index
                    if o.estimator == "reinforce_pp_baseline"
                    else None,
                    turn_rewards=batch.turn_rewards,
                )
            elif isinstance(o, PPOOptions):
                values = _require(batch.values, "values", "PPO's GAE").to(rewards.dtype)
                adv, returns = est.gae(
                    est.token_rewards(rewards, m, penalty, batch.turn_rewards),
                    values,
                    m,
                    gamma=o.gamma,
                    lam=o.gae_lambda,
                )
                if o.normalize_advantages:
                    adv = masked_whiten(adv, m, 1e-8)
                batch.advantages = adv
                batch.returns = returns
            else:  # pragma: no cover - the options classes above are exhaustive
                raise TypeError(f"no estimator for options {type(o).__name__}")

    # --- loss ----------------------------------------------------------------------------

    def _correction(self, batch: TokenBatch, m: Tensor) -> tuple[Tensor | None, dict[str, float]]:
        o = self.options
        if o.off_policy_correction == "none":
            return None, {}
        old = _require(batch.old_logprobs, "old_logprobs", "off_policy_correction")
        w, raw, outside = importance_weight(
            old,
            batch.rollout_logprobs.to(old.dtype),
            m,
            mode=o.off_policy_correction,
            level=o.correction_level,
            high=o.is_max,
            low=o.is_min,
        )
        unit = (m.sum(-1, keepdim=True) > 0).to(m.dtype) if o.correction_level == "sequence" else m
        metrics = _stats("is_weight", raw, unit)
        name = "is_truncated_fraction" if o.off_policy_correction == "tis" else "is_masked_fraction"
        metrics[name] = float(masked_mean(outside.to(m.dtype).expand_as(unit), unit))
        return w, metrics

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Clipped surrogate (+ KL, - entropy bonus, + value loss) aggregated per options."""
        o = self.options
        adv = _require(batch.advantages, "advantages", "the policy loss (call compute_advantages)")
        adv = adv.to(logprobs.dtype).detach()
        m = _mask(batch, logprobs)
        behaviour = self.behaviour_logprobs(batch).to(logprobs.dtype)
        token_log_ratio = logprobs - behaviour
        ratio = importance_ratio(logprobs, behaviour, m, o.ratio_level)
        if o.ratio_level == "sequence":
            unit = (m.sum(-1, keepdim=True) > 0).to(m.dtype)
        else:
            unit = m
        pg = clipped_surrogate(ratio, adv, o.clip_eps_low, o.clip_eps_high, o.dual_clip_c)
        dual_fraction = 0.0
        if o.dual_clip_c is not None:
            with torch.no_grad():
                undual = clipped_surrogate(ratio, adv, o.clip_eps_low, o.clip_eps_high)
                dual = (pg < undual).to(m.dtype).expand_as(m)
                dual_fraction = float(masked_mean(dual, m))
        weight, metrics = self._correction(batch, m)
        if weight is not None:
            pg = pg * weight
        per_token = pg
        kl_ref = None
        if o.kl_coef > 0 and o.kl_mode == "loss":
            ref = _require(batch.ref_logprobs, "ref_logprobs", "kl_mode='loss' with kl_coef > 0")
            kl_ref = kl_estimate(logprobs, ref.to(logprobs.dtype), o.kl_type)
            per_token = per_token + o.kl_coef * kl_ref
        loss = aggregate(per_token, m, o.loss_agg, o.max_response_length)
        if o.entropy_coef > 0:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs loss(..., entropy=[B, T]); it is None")
            ent = entropy
            # A token mean whatever the aggregation: the bonus is a regulariser, not a
            # per-sequence objective (TRL does the same).
            loss = loss - o.entropy_coef * masked_mean(ent, m)
        with torch.no_grad():
            metrics.update(
                self._surrogate_metrics(adv, ratio, m, unit, pg, token_log_ratio, dual_fraction)
            )
            if kl_ref is not None:
                metrics["kl_ref"] = float(masked_mean(kl_ref.detach(), m))
            metrics.update(_entropy_metric(entropy, m))
            metrics.update(mismatch_metrics(batch, logprobs))
        if isinstance(o, PPOOptions):
            loss = loss + self._value_loss(batch, values, m, metrics)
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def _surrogate_metrics(
        self,
        adv: Tensor,
        ratio: Tensor,
        m: Tensor,
        unit: Tensor,
        pg: Tensor,
        token_log_ratio: Tensor,
        dual_fraction: float,
    ) -> dict[str, float]:
        """The policy term, the clipping fractions, the k3 KL to the behaviour policy and the
        ratio's statistics (called under ``torch.no_grad``)."""
        o = self.options
        a = adv.expand_as(m)
        r = ratio.expand_as(m)
        low = (r < 1 - o.clip_eps_low) & (a < 0)
        high = (r > 1 + o.clip_eps_high) & (a > 0)

        def fraction(flag: Tensor) -> float:
            # Per ratio unit: tokens, or sequences when the ratio is per sequence.
            f = flag.to(m.dtype)
            if o.ratio_level == "sequence":
                f = masked_mean(f, m, dim=-1).unsqueeze(-1)
            return float(masked_mean(f.expand_as(unit), unit))

        metrics = {
            "loss/policy": float(aggregate(pg.detach(), m, o.loss_agg, o.max_response_length)),
            "clip_fraction": fraction(low | high),
            "clip_fraction/low": fraction(low),
            "clip_fraction/high": fraction(high),
            "dual_clip_fraction": dual_fraction,
            # k3 estimate of KL(pi_behaviour || pi_theta) on the behaviour's samples.
            "approx_kl": float(masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, m)),
        }
        metrics.update(_stats("ratio", ratio.detach(), unit))
        return metrics

    def _value_loss(
        self, batch: TokenBatch, values: Tensor | None, m: Tensor, metrics: dict[str, float]
    ) -> Tensor:
        """``value_coef * agg(0.5 * max((v - R)^2, (clip(v, V_old +/- c) - R)^2))``."""
        o = self.options
        assert isinstance(o, PPOOptions) and o.critic is not None
        if values is None:
            raise ValueError("PPO's value loss needs the critic's loss(..., values=[B, T])")
        v = values
        old = _require(batch.values, "values", "PPO's value clipping").to(v.dtype).detach()
        ret = _require(batch.returns, "returns", "PPO's value loss").to(v.dtype).detach()
        vf1 = (v - ret) ** 2
        if o.critic.value_clip is not None:
            clipped = old + torch.clamp(v - old, -o.critic.value_clip, o.critic.value_clip)
            vf2 = (clipped - ret) ** 2
            vf = 0.5 * torch.maximum(vf1, vf2)
            metrics["value_clip_fraction"] = float(masked_mean((vf2 > vf1).to(m.dtype), m))
        else:
            vf = 0.5 * vf1
        vloss = aggregate(vf, m, o.loss_agg, o.max_response_length)
        metrics["loss/value"] = float(vloss.detach())
        metrics["explained_variance"] = explained_variance(v.detach(), ret, m)
        metrics.update(_stats("values", v.detach(), m))
        metrics.update(_stats("returns", ret, m))
        return o.critic.value_coef * vloss


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens (population variances): 1 for a
    critic that predicts the returns, 0 for one no better than their mean, negative for worse;
    0.0 when the returns do not vary (nothing to explain)."""
    with torch.no_grad():
        m = mask.to(values.dtype)

        def var(x: Tensor) -> Tensor:
            mean = masked_mean(x, m)
            return masked_mean((x - mean) ** 2, m)

        total = var(returns.to(values.dtype))
        if float(total) <= 0.0:
            return 0.0
        return float(1.0 - var(returns.to(values.dtype) - values) / total)


class OnPolicyDistillation:
    """Per-token reverse KL(pi_theta || pi_teacher) on the policy's own samples.

    The surrogate ``sg(w_t d_t) * exp(log pi_t - sg(log pi_t))`` with ``d_t = log pi_t - log
    pi_teacher_t`` has the value ``w_t d_t`` (the k1 estimate of the reverse KL) and the
    gradient ``w_t d_t grad log pi_t``, the score-function gradient of the reverse KL per
    token. ``w_t = min(pi_t / pi_rollout_t, is_max)`` corrects for samples an older policy
    generated (the asynchronous loop); on fresh samples it is 1 up to the train-rollout
    mismatch. ``is_max: null`` sets ``w_t = 1``.
    """

    needs = frozenset({"teacher_logprobs"})

    def __init__(self, options: DistillationOptions) -> None:
        self.options = options

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Fill ``batch.advantages`` with the per-token reward ``log pi_teacher - log pi_rollout``
        (what the loss's gradient weighs each token by at the sampling policy)."""
        teacher = _require(batch.teacher_logprobs, "teacher_logprobs", "on-policy distillation")
        with torch.no_grad():
            m = _mask(batch, batch.rollout_logprobs)
            batch.advantages = (teacher - batch.rollout_logprobs) * m

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Reverse-KL surrogate aggregated per options, times ``coef``."""
        o = self.options
        teacher = _require(batch.teacher_logprobs, "teacher_logprobs", "on-policy distillation")
        m = _mask(batch, logprobs)
        d = logprobs.detach() - teacher.to(logprobs.dtype)
        log_ratio = logprobs.detach() - batch.rollout_logprobs.to(logprobs.dtype)
        weight = torch.ones_like(d)
        if o.is_max is not None:
            weight = torch.exp(log_ratio).clamp(max=o.is_max)
        per_token = weight * d * torch.exp(logprobs - logprobs.detach())
        loss = o.coef * aggregate(per_token, m, o.loss_agg, o.max_response_length)
        with torch.no_grad():
            metrics = {"reverse_kl": float(masked_mean(d, m)), "loss": float(loss)}
            if o.is_max is not None:
                truncated = (torch.exp(log_ratio) > o.is_max).to(m.dtype)
                metrics["is_truncated_fraction"] = float(masked_mean(truncated, m))
            metrics["approx_kl"] = float(masked_mean(torch.expm1(log_ratio) - log_ratio, m))
            metrics.update(_stats("ratio", torch.exp(log_ratio), m))
            metrics.update(_entropy_metric(entropy, m))
            metrics.update(mismatch_metrics(batch, logprobs))
        return loss, metrics


class SFT:
    """Supervised fine-tuning: negative log-likelihood of the loss-masked tokens."""

    needs: frozenset[str] = frozenset()

    def __init__(self, options: SFTOptions) -> None:
        self.options = options

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Every loss token weighs 1: ``batch.advantages`` is the mask."""
        batch.advantages = batch.response_mask.to(batch.rollout_logprobs.dtype).clone()

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """``agg(-log pi)`` over the loss tokens."""
        o = self.options
        m = _mask(batch, logprobs)
        loss = aggregate(-logprobs, m, o.loss_agg, o.max_response_length)
        with torch.no_grad():
            metrics = {"nll": float(masked_mean(-logprobs.detach(), m)), "loss": float(loss)}
            metrics.update(_entropy_metric(entropy, m))
            # Conversations from data carry no engine log-probs (all 0.0): a mismatch against
            # them would only repeat the NLL. Samples the engine generated have them.
            if bool((batch.rollout_logprobs.to(m.dtype) * m).abs().sum() > 0):
                metrics.update(mismatch_metrics(batch, logprobs))
        return loss, metrics


def build_policy_gradient(options: PolicyLossOptions) -> PolicyGradient:
    """Factory of GRPO, Dr. GRPO, GSPO, PPO and REINFORCE++ (the options pick the estimator)."""
    return PolicyGradient(options)


def build_distillation(options: DistillationOptions) -> OnPolicyDistillation:
    """Factory of on-policy distillation."""
    return OnPolicyDistillation(options)


def build_sft(options: SFTOptions) -> SFT:
    """Factory of SFT."""
    return SFT(options)
