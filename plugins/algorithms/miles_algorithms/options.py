"""Options of every algorithm: the pydantic models a run config's ``algorithm.options`` is
validated against.

This module imports no torch, so listing plugins or validating a config stays cheap. Every
enumeration is a ``Literal`` and every bound a ``Field`` constraint, so a bad value is an error
that names the field and lists what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: How per-token terms are reduced to the scalar loss.
#: ``token_mean``: sum over all loss tokens / number of loss tokens (DAPO, TRL's ``bnpo``).
#: ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (GRPO paper).
#: ``constant``: sum over all loss tokens / (B * max_response_length) (Dr. GRPO).
LossAgg = Literal["token_mean", "seq_mean_token_mean", "constant"]

#: Estimators of KL(pi_theta || pi_ref) from samples of pi_theta, d = log pi_theta - log pi_ref:
#: ``k1`` = d, ``k2`` = d**2 / 2, ``k3`` = exp(-d) + d - 1 (Schulman's unbiased, non-negative one).
KLType = Literal["k1", "k2", "k3"]

BehaviourPolicy = Literal["rollout", "recomputed"]
OffPolicyCorrection = Literal["none", "tis", "mis"]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyLossOptions(_Options):
    """Options shared by every algorithm with a PPO-style clipped policy loss.

    The ratio is ``pi_theta / pi_behaviour`` where the behaviour policy is chosen with
    ``behaviour_policy``; ``off_policy_correction`` adds a detached importance weight
    ``pi_recomputed / pi_rollout`` (truncated or masked) for the train-rollout mismatch.
    """

    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="ratio lower clip: 1 - clip_eps_low")
    clip_eps_high: float = Field(
        0.2, ge=0, description="ratio upper clip: 1 + clip_eps_high (clip-higher when > low)"
    )
    dual_clip_c: float | None = Field(
        None, gt=1, description="dual clip: bound the loss of negative-advantage tokens at c * |A|"
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="'sequence' = GSPO: exp(mean token log-ratio), clipped per sequence"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference policy")
    kl_type: KLType = "k3"
    kl_mode: Literal["loss", "reward"] = Field(
        "loss", description="'loss': add kl_coef * KL to the loss; 'reward': shape the rewards"
    )
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: loss -= coef * entropy")
    loss_agg: LossAgg = "seq_mean_token_mean"
    max_response_length: int | None = Field(
        None, gt=0, description="the constant of loss_agg='constant' (default: padded width T)"
    )
    behaviour_policy: BehaviourPolicy | None = Field(
        None,
        description=(
            "denominator of the ratio: 'rollout' = the engine's log-probs, 'recomputed' = "
            "old_logprobs recomputed by the trainer. None picks 'recomputed' when old_logprobs "
            "are given, else 'rollout', and is refused in an asynchronous run"
        ),
    )
    off_policy_correction: OffPolicyCorrection = Field(
        "none",
        description=(
            "'tis' truncated / 'mis' masked importance weight pi_recomputed / pi_rollout; "
            "needs behaviour_policy='recomputed'"
        ),
    )
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="importance weight per token, or one per sequence (product)"
    )
    is_max: float = Field(2.0, gt=0, description="TIS truncation / MIS upper bound")
    is_min: float | None = Field(None, ge=0, description="TIS floor / MIS lower bound")

    @field_validator("off_policy_correction")
    @classmethod
    def _correction_needs_recomputed(cls, value: str, info: ValidationInfo) -> str:
        # The weight corrects from the engine's distribution to the trainer's recomputed one; with
        # the engine's log-probs as the ratio's denominator there is nothing left to correct.
        if value != "none" and info.data.get("behaviour_policy") != "recomputed":
            raise ValueError(
                f"off_policy_correction={value!r} weights tokens by pi_recomputed / pi_rollout, "
                "so it needs behaviour_policy='recomputed' (allowed behaviour_policy: "
                "'rollout', 'recomputed'); with behaviour_policy='rollout' use "
                "off_policy_correction='none'"
            )
        return value

    @field_validator("is_min")
    @classmethod
    def _min_below_max(cls, value: float | None, info: ValidationInfo) -> float | None:
        high = info.data.get("is_max")
        if value is not None and high is not None and value >= high:
            raise ValueError(f"is_min ({value}) must be below is_max ({high})")
        return value


class GRPOOptions(PolicyLossOptions):
    """GRPO: advantage = reward minus its group's mean, divided by a standard deviation.

    ``estimator='dr_grpo'`` drops the division (Dr. GRPO); ``scale_rewards`` then must stay
    ``None`` or ``'none'``.
    """

    estimator: Literal["grpo", "dr_grpo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None,
        description="std used to scale: of the group, of the whole batch, or none "
        "(default: 'group' for grpo, 'none' for dr_grpo)",
    )
    std_unbiased: bool = Field(True, description="Bessel-corrected std (as TRL)")
    std_eps: float = Field(1e-6, ge=0, description="added to the std before dividing")

    @field_validator("scale_rewards")
    @classmethod
    def _dr_grpo_does_not_scale(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("estimator") == "dr_grpo" and value not in (None, "none"):
            raise ValueError(
                f"estimator 'dr_grpo' does not divide by a standard deviation, so scale_rewards "
                f"must be None or 'none' (got {value!r}); use estimator 'grpo' to scale"
            )
        return value

    def resolved_scale(self) -> str:
        """The effective ``scale_rewards`` once the estimator's default is applied."""
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "group" if self.estimator == "grpo" else "none"


class DrGRPOOptions(GRPOOptions):
    """Dr. GRPO: group-mean baseline without std division, constant loss normaliser."""

    estimator: Literal["grpo", "dr_grpo"] = "dr_grpo"
    loss_agg: LossAgg = "constant"


class GSPOOptions(GRPOOptions):
    """GSPO: GRPO advantages with a sequence-level ratio clipped per sequence (paper's eps)."""

    ratio_level: Literal["token", "sequence"] = "sequence"
    clip_eps_low: float = Field(3e-4, ge=0, lt=1)
    clip_eps_high: float = Field(4e-4, ge=0)


class CriticOptions(_Options):
    """The critic's loss: ``value_coef * 0.5 * max((v - R)^2, (v_clipped - R)^2)``."""

    value_coef: float = Field(0.5, ge=0, description="weight of the value loss")
    value_clip: float | None = Field(
        0.2, gt=0, description="clip new values to old +/- value_clip (None: no clipping)"
    )


class PPOOptions(PolicyLossOptions):
    """PPO: a critic's values, GAE(gamma, lambda) advantages, clipped value loss."""

    estimator: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    normalize_advantages: bool = Field(True, description="whiten advantages over the batch")
    # Frozen, so one shared default instance is safe.
    critic: CriticOptions | None = CriticOptions.model_validate({})
    loss_agg: LossAgg = "token_mean"

    @field_validator("critic", mode="before")
    @classmethod
    def _critic_required(cls, value: Any) -> Any:
        if value is None:
            raise ValueError(
                "PPO trains a critic, so critic must be set (fields: value_coef, value_clip); "
                "for a critic-free algorithm choose one of: grpo, dr_grpo, gspo, reinforce_pp, "
                "reinforce_pp_baseline"
            )
        return value


class ReinforcePPOptions(PolicyLossOptions):
    """REINFORCE++: token-level discounted return with KL shaping, globally normalised.

    ``estimator='reinforce_pp_baseline'`` first subtracts each group's mean reward.
    """

    estimator: Literal["reinforce_pp", "reinforce_pp_baseline"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0, le=1)
    kl_coef: float = Field(0.0, ge=0)
    kl_type: KLType = "k1"
    kl_mode: Literal["loss", "reward"] = "reward"
    loss_agg: LossAgg = "token_mean"
    std_eps: float = Field(1e-8, ge=0, description="added to the batch std before dividing")


class ReinforcePPBaselineOptions(ReinforcePPOptions):
    """REINFORCE++ with a group-mean baseline."""

    estimator: Literal["reinforce_pp", "reinforce_pp_baseline"] = "reinforce_pp_baseline"


class DistillationOptions(_Options):
    """On-policy distillation: per-token reverse KL(pi_theta || pi_teacher) on own samples."""

    coef: float = Field(1.0, gt=0, description="weight of the reverse-KL term")
    is_max: float | None = Field(
        2.0,
        gt=0,
        description="samples generated by an older policy (the asynchronous loop) are weighed "
        "per token by pi_theta / pi_rollout, truncated at this value; null: no weight (the "
        "samples are taken as the current policy's)",
    )
    loss_agg: LossAgg = "token_mean"
    max_response_length: int | None = Field(None, gt=0)


class SFTOptions(_Options):
    """Supervised fine-tuning: negative log-likelihood of the loss-masked tokens."""

    loss_agg: LossAgg = "token_mean"
    max_response_length: int | None = Field(None, gt=0)
