"""The run config's adapter: validated with the adapter's own options, composed only with a
backend that lists it and an engine that serves LoRA, refused otherwise with the reason."""

from __future__ import annotations

from typing import Any

import miles_algorithms.plugin
import miles_backend_fsdp2.plugin
import miles_backend_megatron.plugin
import miles_engine_embedded.plugin
import miles_lora.plugin
import miles_transport_broadcast.plugin
import miles_transport_colocated.plugin
import pytest

from miles_core import RolloutEngine, Transport, hookimpl
from miles_core.components import Kind
from miles_core.config import validate_config
from miles_core.errors import ConfigError, IncompatibleError
from miles_core.testing.contracts import check_component


class _PlainEngine:
    """An engine that serves no LoRA."""

    @staticmethod
    @hookimpl
    def miles_register_rollout_engines(register: Any) -> None:
        register(
            RolloutEngine(
                name="plain",
                factory=lambda options: None,
                capabilities=frozenset({"update_weights_from_tensor"}),
            )
        )


class _LoraOnlyEngine:
    """SGLang's set: the LoRA API and the distributed update, no adapter committed by one."""

    @staticmethod
    @hookimpl
    def miles_register_rollout_engines(register: Any) -> None:
        register(
            RolloutEngine(
                name="sglang_like",
                factory=lambda options: None,
                capabilities=frozenset({"lora", "update_weights_from_distributed"}),
            )
        )


class _FullOnlyTransport:
    """A transport that publishes whole models only."""

    @staticmethod
    @hookimpl
    def miles_register_transports(register: Any) -> None:
        register(
            Transport(
                name="full_only",
                factory=lambda options: None,
                engine_capabilities=frozenset({"update_weights_from_tensor"}),
            )
        )


@pytest.fixture
def registry(miles_register, miles_registry):
    for module in (
        miles_lora.plugin,
        miles_backend_fsdp2.plugin,
        miles_backend_megatron.plugin,
        miles_engine_embedded.plugin,
        miles_transport_colocated.plugin,
        miles_transport_broadcast.plugin,
        miles_algorithms.plugin,
    ):
        miles_register(module, name=module.__name__, distribution=module.__name__)
    miles_register(_PlainEngine(), name="plain", distribution="plain")
    miles_register(_LoraOnlyEngine(), name="sglang_like", distribution="sglang_like")
    miles_register(_FullOnlyTransport(), name="full_only", distribution="full_only")
    return miles_registry()


def _raw(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "run": {"steps": 2},
        "model": {"path": "/models/tiny"},
        "backend": {"name": "fsdp2"},
        "engine": {"name": "embedded", "enable_lora": True},
        "algorithm": "grpo",
        "transport": "colocated",
        "reward": "last_number",
        "data": {"name": "jsonl", "path": "prompts.jsonl"},
        "adapter": {"name": "lora", "rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
    }
    raw.update(changes)
    return raw


def test_lora_with_fsdp2_on_a_lora_engine_validates(registry) -> None:
    config = validate_config(_raw(), registry)
    assert config.adapter is not None and config.adapter.name == "lora"
    assert config.adapter.options.rank == 4
    assert config.to_plain()["adapter"]["target_modules"] == ["q_proj"]
    assert config.selected()["adapter"] == ["lora"]
    check_component(registry.get(Kind.ADAPTER, "lora"))


def test_no_adapter_is_none(registry) -> None:
    raw = _raw()
    del raw["adapter"]
    assert validate_config(raw, registry).adapter is None


def test_adapter_with_megatron_is_refused_naming_both(registry) -> None:
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(backend={"name": "megatron"}), registry)
    text = str(err.value)
    assert "adapter 'lora' (adapter.name) does not compose with trainer backend 'megatron'" in text
    assert "backends that take 'lora': fsdp2" in text


def test_adapter_with_an_engine_without_lora_is_refused(registry) -> None:
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(engine="plain"), registry)
    text = str(err.value)
    assert "needs the engine capabilities ['lora']" in text
    assert "engine 'plain' (engine.name)" in text
    assert "engines that do: embedded" in text


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        ({"name": "lora", "rank": 0}, "adapter.rank: Input should be greater than or equal to 1"),
        ({"name": "lora", "ranks": 4}, "adapter.ranks: unknown key 'ranks'; allowed: rank"),
        ({"name": "lora", "target_modules": ["q_proj", "(["]}, "is not a valid regular"),
        ({"name": "lora", "served_name": "a b"}, "adapter.served_name"),
        ({"name": "lorra"}, "adapter.name: no adapter 'lorra'; installed: lora"),
    ],
)
def test_bad_adapter_options_name_the_field(registry, adapter, expected) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(_raw(adapter=adapter), registry)
    assert expected in str(err.value)


def test_adapter_on_engines_started_without_lora_is_refused(registry) -> None:
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(engine="embedded"), registry)
    assert "needs engine option enable_lora: true" in str(err.value)


def test_a_transport_that_cannot_publish_an_adapter_is_refused(registry) -> None:
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(transport="full_only"), registry)
    text = str(err.value)
    assert "transport 'full_only' (transport.name) cannot publish an adapter alone" in text
    assert "transports that can: broadcast, colocated" in text


def test_broadcast_needs_the_engine_to_commit_an_adapter(registry) -> None:
    raw = _raw(engine="sglang_like", transport="broadcast")
    raw["run"]["placement"] = "disaggregated"
    with pytest.raises(IncompatibleError) as err:
        validate_config(raw, registry)
    text = str(err.value)
    assert "capabilities ['lora_weight_updates'], which engine 'sglang_like'" in text
    # the embedded engine commits one
    raw["engine"] = {"name": "embedded", "enable_lora": True}
    assert validate_config(raw, registry).transport.name == "broadcast"
