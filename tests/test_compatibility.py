"""Compatibility as data: a third-party record's capabilities and needs are checked by the one
checker, with no change to the core."""

from __future__ import annotations

import types
from typing import Any

import pytest

from miles_core import hookimpl
from miles_core.components import (
    ENGINE_CAPABILITIES,
    Adapter,
    Algorithm,
    MetricSink,
    Need,
    RolloutEngine,
    TrainerBackend,
    Transport,
)
from miles_core.config import validate_config
from miles_core.errors import IncompatibleError


def _build(options: Any) -> Any:
    return options


def _plugin() -> types.ModuleType:
    """Parts of a third party: a transport needing an engine capability the core has never
    heard of, an engine serving it, and a metric sink needing a backend capability while the
    run trains an adapter."""

    @hookimpl
    def miles_register_trainer_backends(register):  # type: ignore[no-untyped-def]
        register(TrainerBackend(name="plain_backend", factory=_build, adapters=frozenset({"tiny"})))
        register(
            TrainerBackend(
                name="stats_backend",
                factory=_build,
                adapters=frozenset({"tiny"}),
                provides=frozenset({"adapter_grad_stats"}),
            )
        )

    @hookimpl
    def miles_register_rollout_engines(register):  # type: ignore[no-untyped-def]
        register(RolloutEngine(name="plain_engine", factory=_build))
        register(
            RolloutEngine(
                name="shm_engine", factory=_build, capabilities=frozenset({"shm_handles"})
            )
        )

    @hookimpl
    def miles_register_transports(register):  # type: ignore[no-untyped-def]
        register(
            Transport(
                name="shm",
                factory=_build,
                engine_capabilities=frozenset({"shm_handles"}),
                adapter_capabilities=frozenset(),
            )
        )

    @hookimpl
    def miles_register_algorithms(register):  # type: ignore[no-untyped-def]
        register(Algorithm(name="plain_algo", factory=_build))

    @hookimpl
    def miles_register_adapters(register):  # type: ignore[no-untyped-def]
        register(Adapter(name="tiny", factory=_build))

    @hookimpl
    def miles_register_metric_sinks(register):  # type: ignore[no-untyped-def]
        register(
            MetricSink(
                name="grad_stats",
                factory=_build,
                demands=(
                    Need(
                        "backend",
                        frozenset({"adapter_grad_stats"}),
                        when="adapter",
                        at="metrics.sinks",
                        says="{who} reports no per-adapter gradient statistics, which {by} needs",
                    ),
                ),
            )
        )

    module = types.ModuleType("third_party_plugin")
    for key, value in list(locals().items()):
        if key.startswith("miles_"):
            setattr(module, key, value)
    return module


def _raw(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"path": "/m"},
        "backend": "plain_backend",
        "engine": "shm_engine",
        "transport": "shm",
        "algorithm": "plain_algo",
        "reward": "exact_match",
        "data": {"name": "jsonl", "path": "train.jsonl"},
        "metrics": {"sinks": ["grad_stats"]},
    }
    raw.update(over)
    return raw


@pytest.fixture
def registry(miles_register: Any, miles_registry: Any) -> Any:
    miles_register(_plugin(), name="third-party", distribution="miles-third-party")
    return miles_registry()


def test_a_new_engine_capability_is_checked_without_a_core_change(registry: Any) -> None:
    assert "shm_handles" not in ENGINE_CAPABILITIES
    assert validate_config(_raw(), registry).transport.name == "shm"
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(engine="plain_engine"), registry)
    text = str(err.value)
    assert (
        "transport 'shm' needs the engine capabilities ['shm_handles'], which engine "
        "'plain_engine' does not serve (it serves: none); engines that do: shm_engine"
    ) in text


def test_a_need_while_a_feature_is_on_is_checked_without_a_core_change(registry: Any) -> None:
    # no adapter: the sink's need does not hold
    assert validate_config(_raw(), registry).metrics.sinks[0].name == "grad_stats"
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(adapter="tiny"), registry)
    assert (
        "metrics.sinks: trainer backend 'plain_backend' (backend.name) reports no per-adapter "
        "gradient statistics, which metric sink 'grad_stats' needs; backends that do: "
        "stats_backend"
    ) in str(err.value)
    config = validate_config(_raw(adapter="tiny", backend="stats_backend"), registry)
    assert config.adapter is not None and config.adapter.name == "tiny"


def test_every_unmet_need_is_reported_at_once(registry: Any) -> None:
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(adapter="tiny", engine="plain_engine"), registry)
    problems = err.value.problems
    assert any(p.startswith("transport 'shm' needs the engine capabilities") for p in problems)
    assert any(p.startswith("metrics.sinks: trainer backend 'plain_backend'") for p in problems)


def test_records_describe_what_they_offer_and_need() -> None:
    sink = MetricSink(
        name="s",
        factory=_build,
        provides=frozenset({"x"}),
        demands=(Need("engine", frozenset({"y"}), when="routing"),),
    )
    assert sink.offers() == frozenset({"x"})
    assert sink.describe()["demands"] == [
        {"role": "engine", "capabilities": ["y"], "when": "routing"}
    ]
    backend = TrainerBackend(name="b", factory=_build, routing=True, adapters=frozenset({"lora"}))
    assert {"routing", "adapter:lora"} <= backend.offers()
    transport = Transport(name="t", factory=_build, engine_capabilities=frozenset({"a"}))
    assert [n.capabilities for n in transport.wants()] == [frozenset({"a"})]


def test_malformed_needs_name_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown role 'trainer'; allowed: backend, engine"):
        Need("trainer", frozenset({"x"}))
    with pytest.raises(ValueError, match=r"unknown feature 'lora'; allowed: adapter"):
        Need("engine", frozenset({"x"}), when="lora")
    with pytest.raises(ValueError, match=r"rollout engine 'e' names invalid capabilities"):
        RolloutEngine(name="e", factory=_build, capabilities=frozenset({"two words"}))
    with pytest.raises(TypeError, match=r"metric sink 's': demands holds"):
        MetricSink(name="s", factory=_build, demands=("engine",))  # type: ignore[arg-type]


def test_a_misspelt_capability_is_refused_with_the_closest_name(
    miles_register: Any, miles_registry: Any
) -> None:
    typo = types.ModuleType("typo_plugin")

    @hookimpl
    def miles_register_transports(register):  # type: ignore[no-untyped-def]
        register(
            Transport(name="typo", factory=_build, engine_capabilities=frozenset({"shm_handle"}))
        )

    typo.miles_register_transports = miles_register_transports  # type: ignore[attr-defined]
    miles_register(_plugin(), name="third-party", distribution="miles-third-party")
    miles_register(typo, name="typo", distribution="miles-typo")
    with pytest.raises(IncompatibleError) as err:
        validate_config(_raw(transport="typo"), miles_registry())
    assert "engines that do: none installed (did you mean 'shm_handles'?)" in str(err.value)
