"""Bad options are pydantic ValidationErrors naming the field and what is allowed."""

from __future__ import annotations

import pytest
from miles_algorithms.options import (
    DistillationOptions,
    DrGRPOOptions,
    GRPOOptions,
    GSPOOptions,
    PPOOptions,
    ReinforcePPOptions,
    SFTOptions,
)
from pydantic import ValidationError


def error(model: type, **options: object) -> tuple[str, tuple]:
    with pytest.raises(ValidationError) as info:
        model(**options)
    (first, *_) = info.value.errors()
    return str(info.value), first["loc"]


def test_unknown_estimator_lists_the_allowed_ones() -> None:
    text, loc = error(GRPOOptions, estimator="gae2")
    assert loc == ("estimator",)
    assert "'grpo' or 'dr_grpo'" in text and "gae2" in text
    text, loc = error(ReinforcePPOptions, estimator="reinforce")
    assert "'reinforce_pp' or 'reinforce_pp_baseline'" in text


def test_ppo_without_a_critic() -> None:
    text, loc = error(PPOOptions, critic=None)
    assert loc == ("critic",)
    assert "value_coef" in text and "value_clip" in text  # the critic's fields
    assert "grpo" in text and "reinforce_pp" in text  # the critic-free alternatives


def test_negative_epsilon() -> None:
    for field in ("clip_eps_low", "clip_eps_high"):
        text, loc = error(GRPOOptions, **{field: -0.1})
        assert loc == (field,)
        assert "greater than or equal to 0" in text
    text, loc = error(GRPOOptions, dual_clip_c=0.5)
    assert loc == ("dual_clip_c",) and "greater than 1" in text


def test_unknown_kl_type() -> None:
    text, loc = error(GRPOOptions, kl_type="k4")
    assert loc == ("kl_type",)
    assert "'k1', 'k2' or 'k3'" in text


def test_other_enumerations_list_their_values() -> None:
    text, _ = error(GRPOOptions, loss_agg="sum")
    assert "'token_mean', 'seq_mean_token_mean' or 'constant'" in text
    text, _ = error(GRPOOptions, behaviour_policy="engine")
    assert "'rollout' or 'recomputed'" in text
    text, _ = error(GRPOOptions, off_policy_correction="is")
    assert "'none', 'tis' or 'mis'" in text
    text, _ = error(SFTOptions, loss_agg="mean")
    assert "token_mean" in text


def test_correction_needs_recomputed_behaviour() -> None:
    text, loc = error(GRPOOptions, off_policy_correction="tis")
    assert loc == ("off_policy_correction",)
    assert "behaviour_policy='recomputed'" in text
    text, loc = error(GRPOOptions, behaviour_policy="rollout", off_policy_correction="mis")
    assert loc == ("off_policy_correction",)
    GRPOOptions(behaviour_policy="recomputed", off_policy_correction="mis")


def test_dr_grpo_does_not_scale() -> None:
    text, loc = error(GRPOOptions, estimator="dr_grpo", scale_rewards="group")
    assert loc == ("scale_rewards",) and "dr_grpo" in text
    assert DrGRPOOptions().resolved_scale() == "none"
    assert GRPOOptions().resolved_scale() == "group"


def test_bounds_and_unknown_fields() -> None:
    text, loc = error(GRPOOptions, is_max=2.0, is_min=3.0)
    assert loc == ("is_min",) and "is_max" in text
    text, loc = error(PPOOptions, gamma=1.5)
    assert loc == ("gamma",) and "less than or equal to 1" in text
    text, loc = error(GRPOOptions, clip_range=0.2)
    assert loc == ("clip_range",) and "Extra inputs are not permitted" in text
    text, loc = error(DistillationOptions, coef=0)
    assert loc == ("coef",)


def test_defaults_of_the_presets() -> None:
    assert DrGRPOOptions().loss_agg == "constant" and DrGRPOOptions().estimator == "dr_grpo"
    gspo = GSPOOptions()
    assert gspo.ratio_level == "sequence" and gspo.clip_eps_low == 3e-4
    assert PPOOptions().critic is not None and PPOOptions().estimator == "gae"
    assert ReinforcePPOptions().kl_mode == "reward"
