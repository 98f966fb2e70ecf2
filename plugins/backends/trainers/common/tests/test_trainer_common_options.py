"""The options every trainer backend takes, the rank helpers and the controller's refusals."""

from __future__ import annotations

import pytest
from miles_trainer_common.controller import TrainerController
from miles_trainer_common.options import TrainerOptions
from miles_trainer_common.rank import check_needs
from pydantic import ValidationError


def test_options_refuse_bad_values_by_name() -> None:
    with pytest.raises(ValidationError, match="lr"):
        TrainerOptions(lr=0)
    with pytest.raises(ValidationError, match=r"each beta must be in \[0, 1\)"):
        TrainerOptions(betas=(0.9, 1.0))
    with pytest.raises(ValidationError, match="needs decay_steps"):
        TrainerOptions(lr_schedule="cosine")
    with pytest.raises(ValidationError, match="must be greater than warmup_steps"):
        TrainerOptions(lr_schedule="cosine", warmup_steps=5, decay_steps=5)
    with pytest.raises(ValidationError, match="extra"):
        TrainerOptions(learning_rate=1e-3)


def test_check_needs_names_the_backend_and_what_it_computes() -> None:
    class Algo:
        needs = frozenset({"old_logprobs", "values"})

    assert check_needs(Algo(), frozenset({"old_logprobs", "values"}), "x") == Algo.needs
    with pytest.raises(ValueError, match=r"the toy backend cannot compute values.*old_logprobs"):
        check_needs(Algo(), frozenset({"old_logprobs"}), "toy")

    class Distil:
        needs = frozenset({"teacher_logprobs"})

    # A teacher's log-probs come with the samples: no backend computes them.
    assert check_needs(Distil(), frozenset(), "toy") == Distil.needs


def test_controller_refuses_calls_before_setup() -> None:
    class Toy(TrainerController):
        name = "toy"

    trainer = Toy(TrainerOptions())
    for call in (trainer.fingerprint, trainer.export_weights, trainer.sleep):
        with pytest.raises(RuntimeError, match="the toy trainer is not set up"):
            call()


def test_critic_options_and_the_critic_schedule_check() -> None:
    from miles_trainer_common.options import CriticOptions, check_critic_schedule

    critic = CriticOptions()
    assert (critic.path, critic.lr, critic.warmup_steps, critic.max_grad_norm) == (
        None,
        1e-5,
        0,
        1.0,
    )
    with pytest.raises(ValidationError, match="extra"):
        CriticOptions.model_validate({"value_coef": 0.5})  # the algorithm's, not the backend's
    cosine = TrainerOptions(lr_schedule="cosine", decay_steps=5)
    check_critic_schedule(cosine, CriticOptions(warmup_steps=4))
    with pytest.raises(ValueError, match=r"greater than critic.warmup_steps \(5\)"):
        check_critic_schedule(cosine, CriticOptions(warmup_steps=5))
    check_critic_schedule(TrainerOptions(), CriticOptions(warmup_steps=50))  # constant: no decay
