"""Registration through the ``miles`` entry point and the placement check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from miles_engine_sglang.launcher import SGLangLauncher
from miles_engine_sglang.options import SGLangEngineConfig

from miles_core import Kind
from miles_core.config import RolloutSection, RunConfig, RunSection, Selection
from miles_core.contracts import EngineLauncher
from miles_core.plugins import load_plugins


def test_registered_through_entry_point() -> None:
    plugins = load_plugins(allow=["sglang"])
    engine = plugins.registry.get(Kind.ROLLOUT_ENGINE, "sglang")
    assert engine.config is SGLangEngineConfig
    assert engine.describe()["devices"] == ["cuda"]
    assert plugins.registry.owner(Kind.ROLLOUT_ENGINE, "sglang").distribution == (
        "miles-engine-sglang"
    )
    launcher = engine.build(SGLangEngineConfig(tp_size=2))
    try:
        assert isinstance(launcher, SGLangLauncher)
        assert isinstance(launcher, EngineLauncher)
        assert launcher.options.tp_size == 2
    finally:
        launcher.shutdown()


def test_importing_the_plugin_imports_no_engine_or_http_library() -> None:
    code = (
        "import sys, miles_engine_sglang.plugin, miles_engine_sglang.launcher; "
        "print(sorted(m for m in ('sglang', 'torch', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _config(placement: str, options: SGLangEngineConfig, routing: str = "none") -> RunConfig:
    # Only the fields the check reads; the full config is validated by miles_core's own tests.
    return RunConfig.model_construct(
        run=RunSection(placement=placement),
        engine=Selection(name="sglang", options=options),
        rollout=RolloutSection(routing=routing),
    )


@pytest.mark.parametrize(
    ("routing", "flag", "refused"),
    [("replay", False, True), ("record", True, False), ("none", False, False)],
)
def test_routing_needs_engines_that_return_the_routed_experts(
    routing: str, flag: bool, refused: bool
) -> None:
    """SGLang returns the routed experts only when started with the flag: a run that records
    or replays the routing without it is refused, naming the option."""
    engine = load_plugins().registry.get(Kind.ROLLOUT_ENGINE, "sglang")
    assert engine.check is not None
    options = SGLangEngineConfig(enable_return_routed_experts=flag)
    problem = engine.check(_config("disaggregated", options, routing))
    if refused:
        assert problem is not None and "enable_return_routed_experts: true" in problem
    else:
        assert problem is None


@pytest.mark.parametrize(
    ("placement", "memory_saver", "refused"),
    [
        ("colocated", False, True),
        ("colocated", True, False),
        ("disaggregated", False, False),
        ("disaggregated", True, False),
    ],
)
def test_colocated_placement_needs_the_memory_saver(
    placement: str, memory_saver: bool, refused: bool
) -> None:
    engine = load_plugins(allow=["sglang"]).registry.get(Kind.ROLLOUT_ENGINE, "sglang")
    assert engine.check is not None
    reason = engine.check(_config(placement, SGLangEngineConfig(enable_memory_saver=memory_saver)))
    if refused:
        assert reason is not None and "enable_memory_saver: true" in reason
    else:
        assert reason is None


def _raw(transport: str, placement: str) -> dict[str, object]:
    return {
        "run": {"steps": 1, "placement": placement},
        "model": {"path": "/models/any"},
        "backend": {"name": "fsdp2"},
        "engine": {"name": "sglang", "enable_memory_saver": True},
        "algorithm": {"name": "grpo"},
        "transport": {"name": transport},
        "reward": "last_number",
        "data": {"name": "jsonl", "path": "prompts.jsonl"},
    }


def test_capabilities_are_sglangs_endpoints_and_not_nixl() -> None:
    engine = load_plugins(allow=["sglang"]).registry.get(Kind.ROLLOUT_ENGINE, "sglang")
    assert engine.capabilities == {
        "input_logprobs",
        "lora",
        "routed_experts",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "memory_occupation",
    }


@pytest.mark.parametrize(
    ("transport", "placement", "refused"),
    [
        ("p2p", "disaggregated", True),
        ("broadcast", "disaggregated", False),
        ("colocated", "colocated", False),
    ],
)
def test_sglang_with_the_p2p_transport_is_refused_at_validation(
    transport: str, placement: str, refused: bool
) -> None:
    from miles_core.config import validate_config
    from miles_core.errors import IncompatibleError

    pytest.importorskip("miles_transport_p2p")
    pytest.importorskip("miles_backend_fsdp2")
    registry = load_plugins(autoload=True).registry
    raw = _raw(transport, placement)
    if not refused:
        validate_config(raw, registry)
        return
    with pytest.raises(IncompatibleError) as err:
        validate_config(raw, registry)
    text = str(err.value)
    assert "transport 'p2p' needs the engine capabilities ['p2p_weights']" in text
    assert "engine 'sglang' does not serve" in text
