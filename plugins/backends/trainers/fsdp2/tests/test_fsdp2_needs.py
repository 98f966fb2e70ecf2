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
        register(
            RolloutEngine(
                name="scoring-engine",
                factory=self._never,
                capabilities=frozenset({"input_logprobs"}),
            )
        )

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


def test_distillation_needs_a_teacher_whose_engine_scores(registry) -> None:
    with pytest.raises(IncompatibleError, match="needs teacher_logprobs: add a teacher section"):
        validate_config(_config("fsdp2", "on_policy_distillation"), registry)
    raw = {**_config("fsdp2", "on_policy_distillation"), "teacher": {"path": "t"}}
    with pytest.raises(IncompatibleError) as info:
        validate_config(raw, registry)
    assert (
        "teacher.engine: engine 'needs-test-engine' does not serve input_logprobs (scoring "
        "tokens it did not generate), which the teacher needs; engines that do: scoring-engine"
    ) in str(info.value)
    # The teacher's log-probs come with the samples: any backend trains on them.
    for backend in ("fsdp2", "no-critic"):
        raw = {
            **_config(backend, "on_policy_distillation"),
            "teacher": {"path": "t", "engine": "scoring-engine"},
        }
        config = validate_config(raw, registry)
        assert config.teacher is not None and config.teacher.engine.name == "scoring-engine"
        assert config.to_plain()["teacher"] == {"path": "t", "engine": {"name": "scoring-engine"}}
    # A teacher the algorithm does not use is refused rather than paid for.
    raw = {**_config("fsdp2", "grpo"), "teacher": {"path": "t", "engine": "scoring-engine"}}
    with pytest.raises(IncompatibleError, match="teacher: algorithm 'grpo' does not use"):
        validate_config(raw, registry)


def test_unknown_computes_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"computes unknown inputs \['critic'\]"):
        TrainerBackend(name="x", factory="m:f", computes=frozenset({"critic"}))
