"""The plugin registers through the real entry point; bad options are errors naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
from miles_backend_fsdp2.options import FSDP2Options
from pydantic import ValidationError

from miles_core import Kind, TrainerBackend
from miles_core.contracts import Trainer
from miles_core.plugins import collect_registry, create_plugin_manager
from miles_core.testing.contracts import check_component


@pytest.fixture(scope="module")
def record() -> TrainerBackend:
    registry = collect_registry(create_plugin_manager(allow=["miles-backend-fsdp2"]))
    rec = registry.get(Kind.TRAINER_BACKEND, "fsdp2")
    assert isinstance(rec, TrainerBackend)
    return rec


def test_registered_through_the_entry_point(record: TrainerBackend) -> None:
    assert record.factory == "miles_backend_fsdp2.trainer:build"
    assert record.config is FSDP2Options
    assert record.devices == ("cpu", "cuda")
    assert record.describe()["devices"] == ["cpu", "cuda"]


def test_builds_a_trainer(record: TrainerBackend) -> None:
    trainer = check_component(record, options=FSDP2Options(lr=1e-5))
    assert isinstance(trainer, Trainer)
    assert trainer.weight_version == 0
    with pytest.raises(RuntimeError, match="not set up"):
        trainer.sleep()


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"lr": -1e-5}, "lr", "greater than 0"),
        ({"precision": "fp16"}, "precision", "'fp32' or 'bf16'"),
        ({"device": "tpu"}, "device", "'cpu' or 'cuda'"),
        ({"world_size": 0}, "world_size", "greater than or equal to 1"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens", "greater than 0"),
        ({"betas": (0.9, 1.0)}, "betas", "[0, 1)"),
        ({"weight_decay": -0.1}, "weight_decay", "greater than or equal to 0"),
        ({"lr_schedule": "linear"}, "lr_schedule", "'constant' or 'cosine'"),
        ({"max_grad_norm": 0}, "max_grad_norm", "greater than 0"),
        ({"learning_rate": 1e-5}, "learning_rate", "Extra inputs are not permitted"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        FSDP2Options.model_validate(options)
    errors = info.value.errors()
    assert [e["loc"][0] for e in errors] == [field]
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("critic", "field", "words"),
    [
        ({"lr": 0}, "lr", "greater than 0"),
        ({"warmup_steps": -1}, "warmup_steps", "greater than or equal to 0"),
        ({"max_grad_norm": 0}, "max_grad_norm", "greater than 0"),
        ({"value_coef": 0.5}, "value_coef", "Extra inputs are not permitted"),
    ],
)
def test_bad_critic_options_name_the_field(critic: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        FSDP2Options.model_validate({"critic": critic})
    assert [e["loc"] for e in info.value.errors()] == [("critic", field)]
    assert words in str(info.value)


def test_critic_defaults() -> None:
    critic = FSDP2Options.model_validate({"critic": {"path": "/ckpt"}}).critic
    assert (critic.path, critic.lr, critic.warmup_steps, critic.max_grad_norm) == (
        "/ckpt",
        1e-5,
        0,
        1.0,
    )
    assert FSDP2Options().critic.path is None  # the policy's checkpoint
    with pytest.raises(ValidationError, match=r"greater than critic.warmup_steps \(8\)"):
        FSDP2Options(lr_schedule="cosine", decay_steps=5, critic={"warmup_steps": 8})


def test_cosine_needs_decay_steps() -> None:
    with pytest.raises(ValidationError, match="needs decay_steps"):
        FSDP2Options(lr_schedule="cosine")
    with pytest.raises(ValidationError, match="greater than warmup_steps"):
        FSDP2Options(lr_schedule="cosine", warmup_steps=10, decay_steps=5)
    assert FSDP2Options(lr_schedule="cosine", decay_steps=5).decay_steps == 5


def test_plugin_import_is_torch_free() -> None:
    code = (
        "import sys, miles_backend_fsdp2.plugin as p; p.backend(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
