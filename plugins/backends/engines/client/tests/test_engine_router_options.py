"""The ``sglang`` router component: registration, options, and refusals before any engine runs
(the start failure starts a real router process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles_engine_client import plugin
from miles_engine_client.plugin import SglangRouterOptions
from miles_engine_client.sglang_router import RouterError, SglangRouter
from pydantic import ValidationError

from miles_core import Kind
from miles_core.contracts import Router as RouterContract
from miles_core.plugins import load_plugins
from miles_core.testing.contracts import check_component


def test_registered_through_entry_point() -> None:
    plugins = load_plugins(allow=["engine-client"])
    router = plugins.registry.get(Kind.ROUTER, "sglang")
    assert router.config is SglangRouterOptions
    assert plugins.registry.owner(Kind.ROUTER, "sglang").distribution == "miles-engine-client"


def test_component_contract(miles_register, miles_registry) -> None:  # type: ignore[no-untyped-def]
    miles_register(plugin, name="engine-client")
    component = miles_registry().get(Kind.ROUTER, "sglang")
    check_component(component, build=False)
    built = component.build(SglangRouterOptions(policy="power_of_two"))
    assert isinstance(built, SglangRouter) and isinstance(built, RouterContract)
    assert built.options.policy == "power_of_two"
    assert built.alive() is False  # not started
    built.stop()  # stopping a router never started is a no-op


@pytest.mark.parametrize(
    ("bad", "field", "says"),
    [
        ({"policy": "fastest"}, "policy", "'round_robin', 'power_of_two', 'cache_aware'"),
        ({"port": 0}, "port", "greater than or equal to 1"),
        ({"startup_timeout_s": 0}, "startup_timeout_s", "greater than 0"),
        ({"log_level": "verbose"}, "log_level", "'debug', 'info', 'warn' or 'error'"),
        ({"polcy": "random"}, "polcy", "Extra inputs are not permitted"),
    ],
)
def test_bad_option_is_a_clear_error(bad: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        SglangRouterOptions.model_validate(bad)
    [e] = err.value.errors()
    assert e["loc"] == (field,)
    assert says in str(err.value)


def test_bad_engine_lists_are_refused() -> None:
    router = SglangRouter()
    with pytest.raises(RouterError, match="at least one engine"):
        router.start([])
    with pytest.raises(RouterError, match="listed twice"):
        router.start(["http://127.0.0.1:1", "http://127.0.0.1:1/"])
    with pytest.raises(RouterError, match=r"http\(s\)://host:port"):
        router.start(["127.0.0.1:1"])
    with pytest.raises(TypeError, match="not one string"):
        router.start("http://127.0.0.1:1")
    with pytest.raises(RouterError, match="not running"):
        router.set_engines(["http://127.0.0.1:1"])


def test_start_failure_names_the_engine_and_shows_the_log(tmp_path: Path) -> None:
    router = SglangRouter(SglangRouterOptions(startup_timeout_s=8, log_dir=str(tmp_path)))
    with pytest.raises(RouterError) as err:
        router.start(["http://127.0.0.1:9"])
    message = str(err.value)
    assert "did not route over exactly ['http://127.0.0.1:9']" in message
    assert "ends with:" in message and "127.0.0.1:9" in message.split("ends with:")[1]
    assert router.process is None and router.alive() is False  # the failed router was stopped
