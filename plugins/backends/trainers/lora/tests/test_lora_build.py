"""Every place that builds a run's trainer hands it the adapter: the core's helper (a local
run's build_parts) and the Ray placement's actor, from the plain-data spec it is sent."""

from __future__ import annotations

import miles_backend_fsdp2.plugin
import miles_backend_megatron.plugin
import miles_lora.plugin
import pytest
from miles_lora.adapter import LoraAdapter
from miles_lora.options import LoraOptions
from miles_ray.host import build_trainer_from

from miles_core.registry import build_trainer


@pytest.fixture
def registry(miles_register, miles_registry):
    for module in (miles_lora.plugin, miles_backend_fsdp2.plugin, miles_backend_megatron.plugin):
        miles_register(module, name=module.__name__, distribution=module.__name__)
    return miles_registry()


def test_the_core_helper_builds_the_backend_with_the_adapter(registry) -> None:
    from miles_backend_fsdp2.options import FSDP2Options

    trainer = build_trainer(
        registry,
        "fsdp2",
        FSDP2Options(lr=1e-3),
        [("lora", LoraOptions(rank=2, served_name="arith"))],
    )
    assert isinstance(trainer.adapter, LoraAdapter)
    assert trainer.adapter.name == "arith" and trainer.adapter.options.rank == 2
    assert trainer.options.lr == 1e-3
    assert build_trainer(registry, "fsdp2", None).adapter is None


def test_the_ray_actor_builds_the_trainer_from_its_spec(registry) -> None:
    spec = {
        "backend": ["fsdp2", {"lr": 0.5, "cpu_threads": 1}],
        "adapters": [["lora", {"rank": 3, "target_modules": ["q_proj"]}]],
    }
    trainer = build_trainer_from(registry, spec)
    assert trainer.options.lr == 0.5
    assert trainer.adapter.options == LoraOptions(rank=3, target_modules=["q_proj"])
    assert build_trainer_from(registry, {**spec, "adapters": []}).adapter is None
    assert build_trainer_from(registry, {"backend": ["fsdp2", {}]}).adapter is None


def test_the_core_helper_builds_megatron_with_the_adapter(registry) -> None:
    from miles_backend_megatron.options import MegatronOptions

    trainer = build_trainer(
        registry, "megatron", MegatronOptions(), [("lora", LoraOptions(rank=2))]
    )
    assert isinstance(trainer.adapter, LoraAdapter) and trainer.adapter.options.rank == 2
    assert build_trainer(registry, "megatron", None).adapter is None
