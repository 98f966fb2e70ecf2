"""The run config's adapter: validated with the adapter's own options, composed only with a
backend that lists it and an engine that serves LoRA, refused otherwise with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import miles_algorithms.plugin
import miles_backend_fsdp2.plugin
import miles_backend_megatron.plugin
import miles_engine_embedded.plugin
import miles_lora.plugin
import miles_transport_broadcast.plugin
import miles_transport_colocated.plugin
import pytest

from miles_core import RolloutEngine, TrainerBackend, Transport, hookimpl
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


def test_adapter_with_megatron_validates(registry) -> None:
    config = validate_config(_raw(backend={"name": "megatron"}), registry)
    assert config.backend.name == "megatron"
    assert config.adapter is not None and config.adapter.options.rank == 4


def test_two_adapters_with_megatron_validate(registry) -> None:
    raw = _raw(
        backend={"name": "megatron"},
        adapters=[
            {"name": "arith", "data": {"name": "jsonl", "path": "arith.jsonl"}},
            {"name": "count"},
        ],
    )
    config = validate_config(raw, registry)
    assert [a.name for a in config.adapters] == ["arith", "count"]


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


# --- several adapters (the config's adapters) ----------------------------------------------


def _two(**changes: Any) -> dict[str, Any]:
    raw = _raw(
        adapters=[
            {
                "name": "arith",
                "options": {"lr": 2e-4},
                "data": {"name": "jsonl", "path": "arith.jsonl"},
                "eval_data": {"name": "jsonl", "path": "arith_eval.jsonl"},
            },
            {"name": "count", "options": {"rank": 8}, "reward": "exact_match"},
        ]
    )
    raw.update(changes)
    return raw


def test_two_adapters_validate_with_their_own_options_data_and_reward(registry) -> None:
    config = validate_config(_two(), registry)
    a, b = config.adapters
    assert (a.name, b.name) == ("arith", "count")
    # the run's adapter options (rank 4, alpha 8, q_proj) under each entry's own
    assert a.adapter.options.rank == 4 and a.adapter.options.lr == 2e-4
    assert b.adapter.options.rank == 8 and b.adapter.options.lr is None
    assert a.adapter.options.served_name == "arith" and b.adapter.options.served_name == "count"
    assert b.adapter.options.target_modules == ["q_proj"]
    assert a.data is not None and a.data.options.path == "arith.jsonl"
    assert b.data is None and b.reward is not None and b.reward.name == "exact_match"
    assert [s.options.served_name for s in config.adapter_selections()] == ["arith", "count"]
    dirs = config.adapter_dirs()
    assert dirs["arith"] == (Path("runs") / "run" / "adapters" / "arith").resolve()
    plain = config.to_plain()["adapters"]
    assert plain[1]["reward"]["name"] == "exact_match" and plain[0]["adapter"]["lr"] == 2e-4
    assert "exact_match" in config.selected()["reward_function"]


def test_adapters_naming_the_same_output_folder_are_refused(registry, tmp_path) -> None:
    raw = _two()
    for entry in raw["adapters"]:
        entry["output_dir"] = str(tmp_path / "out")
    with pytest.raises(IncompatibleError) as err:
        validate_config(raw, registry)
    assert "'count' and 'arith' name the same output folder" in str(err.value)
    raw["adapters"][1]["output_dir"] = str(tmp_path / "out" / "inner")
    with pytest.raises(IncompatibleError, match="one inside the other"):
        validate_config(raw, registry)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"name": "arith"}, "adapters[1].name: 'arith' is named twice"),
        ({"name": "a/b"}, "adapters[1].name: 'a/b' is not a served name"),
        ({"rate": 1}, "adapters[1]: unknown key 'rate'; allowed: name, options"),
        ({"options": {"rank": 0}}, "adapters[1].options.rank"),
        ({"options": {"served_name": "x"}}, "the served name is adapters[1].name"),
        ({"data": {"name": "nope"}}, "adapters[1].data.name: no data source 'nope'"),
    ],
)
def test_a_bad_entry_is_refused_naming_its_field(registry, change, expected) -> None:
    raw = _two()
    raw["adapters"][1].update(change)
    with pytest.raises(ConfigError) as err:
        validate_config(raw, registry)
    assert expected in str(err.value)


def test_adapters_need_the_adapter_section(registry) -> None:
    raw = _two()
    del raw["adapter"]
    with pytest.raises(ConfigError, match="adapters: needs an adapter section"):
        validate_config(raw, registry)


def test_the_held_out_loss_of_several_adapters_is_refused(registry) -> None:
    raw = _two(eval={"loss_data": {"name": "jsonl", "path": "x.jsonl"}})
    with pytest.raises(IncompatibleError, match=r"eval\.loss_data: the held-out loss"):
        validate_config(raw, registry)


class _OneAdapterBackend:
    @staticmethod
    @hookimpl
    def miles_register_trainer_backends(register: Any) -> None:
        register(
            TrainerBackend(
                name="one_lora", factory=lambda options: None, adapters=frozenset({"lora"})
            )
        )


def test_a_backend_that_trains_one_adapter_refuses_several(
    registry, miles_register, miles_registry
) -> None:
    miles_register(_OneAdapterBackend(), name="one_lora", distribution="one_lora")
    with pytest.raises(IncompatibleError) as err:
        validate_config(_two(backend="one_lora"), miles_registry())
    text = str(err.value)
    assert "trainer backend 'one_lora' (backend.name) trains one adapter at a time" in text
    assert "backends that train several: fsdp2, megatron" in text


def test_a_critic_for_several_adapters_is_refused(registry) -> None:
    with pytest.raises(IncompatibleError, match="one critic cannot serve 2 policies"):
        validate_config(_two(algorithm="ppo"), registry)


def test_adapters_that_all_name_their_data_and_reward_need_none_of_the_run(registry) -> None:
    raw = _two()
    del raw["data"], raw["reward"]
    raw["adapters"][0]["reward"] = "last_number"
    raw["adapters"][1]["data"] = {"name": "jsonl", "path": "count.jsonl"}
    config = validate_config(raw, registry)
    assert config.data.options.path == "arith.jsonl" and config.reward.name == "last_number"
    del raw["adapters"][1]["data"]
    with pytest.raises(ConfigError, match="data: required section missing"):
        validate_config(raw, registry)
