"""At start, through the real config validation: PPO runs on fsdp2 (it trains a critic); an
algorithm needing what a backend declares it cannot compute is refused, naming both."""

from __future__ import annotations

import pytest

from miles_core import RolloutEngine, TrainerBackend, Transport, hookimpl
from miles_core.config import validate_config
from miles_core.errors import IncompatibleError
from miles_core.plugins import collect_registry, create_plugin_manager


class Slots:
    """In-test engine and transport (never built: validation builds nothing), and a trainer
    backend that declares it computes log-probs only, no critic."""

    @staticmethod
    def _never(options: object) -> None:
        raise AssertionError("config validation must not build components")

    @hookimpl
    def miles_register_trainer_backends(self, register) -> None:
        register(
            TrainerBackend(
                name="no-critic",
                factory=self._never,
                computes=frozenset({"old_logprobs", "ref_logprobs"}),
            )
        )

    @hookimpl
    def miles_register_rollout_engines(self, register) -> None:
        register(RolloutEngine(name="needs-test-engine", factory=self._never))

    @hookimpl
    def miles_register_transports(self, register) -> None:
        register(Transport(name="needs-test-transport", factory=self._never))


@pytest.fixture(scope="module")
def registry():
    pm = create_plugin_manager(allow=["miles-algorithms", "miles-backend-fsdp2"])
    pm.register_plugin(Slots(), name="needs-test-slots", distribution="tests", version="0")
    return collect_registry(pm)


def _config(backend: str, algorithm: str) -> dict:
    return {
        "run": {"mode": "sync", "placement": "disaggregated"},
        "model": {"path": "unused"},
        "backend": backend,
        "engine": "needs-test-engine",
        "transport": "needs-test-transport",
        "algorithm": algorithm,
        "reward": "exact_match",
        "data": {"name": "jsonl", "path": "unused.jsonl"},
    }


def test_ppo_on_fsdp2_is_valid(registry) -> None:
    config = validate_config(_config("fsdp2", "ppo"), registry)
    assert config.backend.options.critic.path is None


def test_a_backend_without_a_critic_is_refused_at_start(registry) -> None:
    with pytest.raises(IncompatibleError) as info:
        validate_config(_config("no-critic", "ppo"), registry)
    text = str(info.value)
    assert (
        "algorithm 'ppo' needs values, which trainer backend 'no-critic' (backend.name) does "
        "not compute (it computes: old_logprobs, ref_logprobs); backends that do: fsdp2"
    ) in text
    # The same backend runs a critic-free algorithm.
    assert validate_config(_config("no-critic", "grpo"), registry).algorithm.name == "grpo"


def test_fsdp2_refuses_a_teacher_at_start(registry) -> None:
    with pytest.raises(IncompatibleError, match="needs teacher_logprobs, which trainer backend "):
        validate_config(_config("fsdp2", "on_policy_distillation"), registry)


def test_unknown_computes_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"computes unknown inputs \['critic'\]"):
        TrainerBackend(name="x", factory="m:f", computes=frozenset({"critic"}))
