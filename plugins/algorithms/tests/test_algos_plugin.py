"""The plugin loads through the real plugin manager and its records hold together."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from miles_core import Algorithm, Kind, RolloutEngine, TrainerBackend, Transport, hookimpl
from miles_core.contracts import AlgorithmImpl, TokenBatch
from miles_core.plugins import collect_registry, create_plugin_manager
from miles_core.testing.contracts import check_component

NAMES = {
    "grpo",
    "dr_grpo",
    "gspo",
    "ppo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "on_policy_distillation",
    "sft",
}


@pytest.fixture(scope="module")
def registry():
    pm = create_plugin_manager(allow=["miles-algorithms"])
    return collect_registry(pm)


def test_registers_through_the_entry_point(registry) -> None:
    assert NAMES <= set(registry.names(Kind.ALGORITHM))
    for name in NAMES:
        owner = registry.owner(Kind.ALGORITHM, name)
        assert owner.distribution == "miles-algorithms"
        assert owner.module == "miles_algorithms.plugin"


def test_records_declare_needs_config_and_ratios(registry) -> None:
    rec = {name: registry.get(Kind.ALGORITHM, name) for name in NAMES}
    assert all(isinstance(r, Algorithm) and r.config is not None for r in rec.values())
    assert "values" in rec["ppo"].needs and "values" not in rec["grpo"].needs
    assert rec["on_policy_distillation"].needs == frozenset({"teacher_logprobs"})
    assert rec["sft"].needs == frozenset()
    # SFT runs on conversations from data unless the config names another rollout function
    assert rec["sft"].default_rollout_function == "sft"
    assert {n for n, r in rec.items() if r.default_rollout_function} == {"sft"}
    ratios = {n for n, r in rec.items() if r.importance_ratios}
    assert ratios == NAMES - {"on_policy_distillation", "sft"}
    assert rec["on_policy_distillation"].excludes == {}
    assert rec["gspo"].describe()["importance_ratios"] is True


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_builds_and_runs_one_step(registry, name: str) -> None:
    record = registry.get(Kind.ALGORITHM, name)
    algo = check_component(record)  # the core's contract check for the kind
    assert isinstance(algo, AlgorithmImpl)
    torch.manual_seed(0)
    b = TokenBatch(
        response_mask=torch.ones(4, 3),
        rollout_logprobs=-torch.rand(4, 3),
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.2]),
        group_index=torch.tensor([0, 0, 1, 1]),
        old_logprobs=-torch.rand(4, 3),
        ref_logprobs=-torch.rand(4, 3),
        teacher_logprobs=-torch.rand(4, 3),
        values=torch.rand(4, 3),
    )
    # The object's own needs are within the record's (the record lists every possible one).
    assert algo.needs <= record.needs
    algo.compute_advantages(b)
    logprobs = (-torch.rand(4, 3)).requires_grad_(True)
    values = torch.rand(4, 3, requires_grad=True)
    loss, metrics = algo.loss(b, logprobs, entropy=torch.rand(4, 3), values=values)
    loss.backward()
    assert torch.isfinite(loss) and logprobs.grad is not None
    assert all(isinstance(v, float) for v in metrics.values())
    assert {"mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl", "entropy"} <= set(metrics)
    if record.importance_ratios:
        assert {"clip_fraction", "approx_kl", "ratio/mean", "ratio/max", "ratio/min"} <= set(
            metrics
        )


def run_config(mode: str, options: object) -> SimpleNamespace:
    # Only what the check reads: config.run.mode and config.algorithm.options.
    return SimpleNamespace(
        run=SimpleNamespace(mode=mode), algorithm=SimpleNamespace(options=options)
    )


def test_async_without_an_off_policy_choice_is_refused(registry) -> None:
    for name in NAMES:
        record = registry.get(Kind.ALGORITHM, name)
        if not record.importance_ratios:
            assert record.check is None
            continue
        assert record.config is not None
        default = record.config()
        reason = record.check(run_config("async", default))
        assert reason is not None
        assert "behaviour_policy" in reason and "'rollout'" in reason and "'recomputed'" in reason
        assert record.check(run_config("sync", default)) is None
        chosen = record.config(behaviour_policy="rollout")
        assert record.check(run_config("async", chosen)) is None
        chosen = record.config(behaviour_policy="recomputed", off_policy_correction="tis")
        assert record.check(run_config("async", chosen)) is None


def test_registering_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from miles_core.plugins import create_plugin_manager, collect_registry\n"
        "collect_registry(create_plugin_manager(allow=['miles-algorithms']))\n"
        "import miles_algorithms.options, miles_algorithms.checks\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class OtherSlots:
    """An in-test plugin filling the slots whose plugins may not be installed here (trainer
    backend, engine, transport), so a whole run config can be validated. Their factories are
    never called: validation does not build components."""

    @staticmethod
    def _never(options: object) -> None:
        raise AssertionError("config validation must not build components")

    @hookimpl
    def miles_register_trainer_backends(self, register) -> None:
        register(TrainerBackend(name="algos-test-backend", factory=self._never))

    @hookimpl
    def miles_register_rollout_engines(self, register) -> None:
        register(RolloutEngine(name="algos-test-engine", factory=self._never))

    @hookimpl
    def miles_register_transports(self, register) -> None:
        register(Transport(name="algos-test-transport", factory=self._never))


@pytest.fixture(scope="module")
def full_registry():
    pm = create_plugin_manager(allow=["miles-algorithms"])
    pm.register_plugin(OtherSlots(), name="algos-test-slots", distribution="tests", version="0")
    return collect_registry(pm)


def raw_config(mode: str, algorithm: dict) -> dict:
    return {
        "run": {"mode": mode, "placement": "disaggregated"},
        "model": {"path": "unused"},
        "backend": "algos-test-backend",
        "engine": "algos-test-engine",
        "transport": "algos-test-transport",
        "algorithm": algorithm,
        "reward": "exact_match",
        "data": {"name": "jsonl", "path": "unused.jsonl"},
    }


def test_async_refusal_through_the_real_config_validation(full_registry) -> None:
    from miles_core.config import validate_config
    from miles_core.errors import IncompatibleError

    with pytest.raises(IncompatibleError) as info:
        validate_config(raw_config("async", {"name": "gspo"}), full_registry)
    text = str(info.value)
    assert "algorithm 'gspo'" in text and "behaviour_policy" in text and "'recomputed'" in text
    ok = validate_config(
        raw_config("async", {"name": "gspo", "behaviour_policy": "rollout"}), full_registry
    )
    assert ok.algorithm.options.behaviour_policy == "rollout"
    assert validate_config(raw_config("sync", {"name": "ppo"}), full_registry).run.mode == "sync"
    # Distillation runs on both loops; what it needs is a teacher.
    with pytest.raises(IncompatibleError, match="needs teacher_logprobs: add a teacher section"):
        validate_config(raw_config("async", {"name": "on_policy_distillation"}), full_registry)


def test_bad_options_through_the_real_config_validation(full_registry) -> None:
    from miles_core.config import validate_config
    from miles_core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        validate_config(raw_config("sync", {"name": "grpo", "kl_type": "k4"}), full_registry)
    assert "algorithm.kl_type" in str(info.value) and "'k3'" in str(info.value)
