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


def test_controller_refuses_calls_before_setup() -> None:
    class Toy(TrainerController):
        name = "toy"

    trainer = Toy(TrainerOptions())
    for call in (trainer.fingerprint, trainer.export_weights, trainer.sleep):
        with pytest.raises(RuntimeError, match="the toy trainer is not set up"):
            call()
