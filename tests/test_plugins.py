"""The plugin manager: loading, provenance, loud failures, allow/block lists, tracing, and one
test per registration hook."""

from __future__ import annotations

import json

import pytest
from core_support import TESTPLUGIN, VALID_CONFIG, run_miles

from miles_core import (
    Adapter,
    Algorithm,
    DataSource,
    GroupFilter,
    LossFunction,
    MetricSink,
    Modality,
    ModelFamily,
    RewardFunction,
    RolloutEngine,
    RolloutFunction,
    Router,
    SampleFilter,
    Schedule,
    TrainerBackend,
    Transport,
    hookimpl,
)
from miles_core.components import Kind
from miles_core.errors import PluginError


def _obj(**hooks: object) -> object:
    """An in-test plugin object carrying the given hook implementations."""
    return type("InTestPlugin", (), {k: staticmethod(v) for k, v in hooks.items()})()


def _plugin(hook: str, *records: object) -> object:
    def impl(register):
        for r in records:
            register(r)

    impl.__name__ = hook
    return _obj(**{hook: hookimpl(impl)})


def _f(options):
    return options


REGISTRATIONS = {
    Kind.TRAINER_BACKEND: TrainerBackend(name="b", factory=_f, devices=("cpu", "cuda")),
    Kind.ROLLOUT_ENGINE: RolloutEngine(name="e", factory=_f),
    Kind.ALGORITHM: Algorithm(name="a", factory=_f, needs=frozenset({"ref_logprobs"})),
    Kind.TRANSPORT: Transport(name="t", factory=_f),
    Kind.MODEL_FAMILY: ModelFamily(name="f", factory=_f),
    Kind.MODALITY: Modality(name="m", factory=_f),
    Kind.ROLLOUT_FUNCTION: RolloutFunction(name="r", factory=_f),
    Kind.REWARD_FUNCTION: RewardFunction(name="rw", factory=_f),
    Kind.SAMPLE_FILTER: SampleFilter(name="sf", factory=_f),
    Kind.GROUP_FILTER: GroupFilter(name="gf", factory=_f),
    Kind.LOSS_FUNCTION: LossFunction(name="l", factory=_f),
    Kind.DATA_SOURCE: DataSource(name="d", factory=_f),
    Kind.METRIC_SINK: MetricSink(name="ms", factory=_f),
    Kind.ROUTER: Router(name="rt", factory=_f),
    Kind.SCHEDULE: Schedule(name="sc", factory=_f),
    Kind.ADAPTER: Adapter(name="ad", factory=_f, engine_capabilities=frozenset({"lora"})),
}


def _check_registration_hook(kind, miles_register, miles_registry, miles_pm):
    record = REGISTRATIONS[kind]
    miles_register(_plugin(kind.hook, record), name="p", distribution="dist-p")
    registry = miles_registry()
    assert registry.get(kind, record.name) is record
    assert registry.owner(kind, record.name).distribution == "dist-p"
    assert miles_pm.infos["p"].registers == {kind.value: [record.name]}


def test_hook_miles_register_trainer_backends(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.TRAINER_BACKEND, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_rollout_engines(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.ROLLOUT_ENGINE, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_algorithms(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.ALGORITHM, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_transports(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.TRANSPORT, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_model_families(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.MODEL_FAMILY, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_modalities(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.MODALITY, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_rollout_functions(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.ROLLOUT_FUNCTION, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_reward_functions(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.REWARD_FUNCTION, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_sample_filters(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.SAMPLE_FILTER, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_group_filters(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.GROUP_FILTER, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_loss_functions(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.LOSS_FUNCTION, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_data_sources(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.DATA_SOURCE, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_metric_sinks(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.METRIC_SINK, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_routers(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.ROUTER, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_schedules(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.SCHEDULE, miles_register, miles_registry, miles_pm)


def test_hook_miles_register_adapters(miles_register, miles_registry, miles_pm):
    _check_registration_hook(Kind.ADAPTER, miles_register, miles_registry, miles_pm)


def test_default_plugins_go_through_the_same_hooks(miles_pm, miles_registry):
    registry = miles_registry()
    assert registry.owner(Kind.REWARD_FUNCTION, "exact_match").distribution == "miles-core"
    assert "text" in registry.names(Kind.MODALITY)
    assert "jsonl" in registry.names(Kind.DATA_SOURCE)
    assert all(i.distribution == "miles-core" for i in miles_pm.infos.values())


def test_duplicate_name_names_both_distributions(miles_register, miles_registry):
    miles_register(
        _plugin(Kind.ALGORITHM.hook, Algorithm(name="grpo", factory=_f)),
        name="one",
        distribution="dist-one",
    )
    miles_register(
        _plugin(Kind.ALGORITHM.hook, Algorithm(name="grpo", factory=_f)),
        name="two",
        distribution="dist-two",
    )
    with pytest.raises(PluginError, match="algorithm 'grpo' is registered twice") as exc:
        miles_registry()
    assert "dist-one" in str(exc.value) and "dist-two" in str(exc.value)


def test_unknown_hook_is_an_error_naming_the_distribution(miles_register):
    bad = _obj(miles_register_rewardz=hookimpl(lambda register: None))
    with pytest.raises(PluginError, match="unknown hook 'miles_register_rewardz'") as exc:
        miles_register(bad, name="typo", distribution="dist-typo")
    assert "dist-typo" in str(exc.value)


def test_wrong_argument_name_is_an_error(miles_register):
    def miles_register_algorithms(registr):  # misspelt argument
        pass

    bad = _obj(miles_register_algorithms=hookimpl(miles_register_algorithms))
    with pytest.raises(PluginError, match="dist-bad"):
        miles_register(bad, name="bad", distribution="dist-bad")


def test_wrong_record_type_is_an_error(miles_register, miles_registry):
    miles_register(
        _plugin(Kind.ALGORITHM.hook, Transport(name="x", factory=_f)),
        name="p",
        distribution="dist-p",
    )
    with pytest.raises(PluginError, match="expected Algorithm"):
        miles_registry()


def test_invalid_names_and_slots_are_refused():
    with pytest.raises(ValueError, match="invalid"):
        Algorithm(name="Bad Name", factory=_f)
    with pytest.raises(ValueError, match="unknown slot 'placment'"):
        Transport(name="t", factory=_f, requires={"placment": ["colocated"]})
    with pytest.raises(ValueError, match="unknown inputs"):
        Algorithm(name="a", factory=_f, needs=frozenset({"critic"}))


def test_lazy_factory_string_is_imported_only_when_built():
    rec = RewardFunction(name="lazy", factory="json:dumps")
    assert rec.load() is json.dumps


# --- entry points, allow/block lists and tracing (real installed distributions) -------------

BROKEN = "raise ImportError('no module named torch_nightly_special')\n"


def test_broken_plugin_fails_plugins_and_train_naming_it(make_dist, tmp_path):
    site = make_dist("miles-broken", "miles_broken", BROKEN)
    (tmp_path / "run.yaml").write_text(VALID_CONFIG)
    for args in (["plugins"], ["train", str(tmp_path / "run.yaml")]):
        out = run_miles(*args, pythonpath=site)
        assert out.returncode == 2, out.stderr
        assert "miles-broken" in out.stderr and "failed to import" in out.stderr
        assert "Traceback" not in out.stderr


def test_blocked_broken_plugin_is_skipped(make_dist):
    site = make_dist("miles-broken", "miles_broken", BROKEN)
    out = run_miles(
        "plugins", "--json", pythonpath=site, env={"MILES_BLOCK_PLUGINS": "miles-broken"}
    )
    assert out.returncode == 0, out.stderr
    assert "miles-broken" not in {p["distribution"] for p in json.loads(out.stdout)}


def test_allow_list_loads_only_that_plugin(make_dist):
    make_dist("miles-broken", "miles_broken", BROKEN)
    site = make_dist("miles-testplugin", "miles_testplugin", TESTPLUGIN)
    out = run_miles("plugins", "--json", pythonpath=site, env={"MILES_PLUGINS": "miles-testplugin"})
    assert out.returncode == 0, out.stderr
    dists = {p["distribution"] for p in json.loads(out.stdout)}
    assert dists == {"miles-core", "miles-testplugin"}
    test = next(p for p in json.loads(out.stdout) if p["distribution"] == "miles-testplugin")
    assert test["version"] == "1.2.3"
    assert test["registers"]["transport"] == ["tbroadcast", "tcolocated"]


def test_plugins_hook_filter_and_text(make_dist):
    site = make_dist("miles-testplugin", "miles_testplugin", TESTPLUGIN)
    env = {"MILES_PLUGINS": "miles-testplugin"}
    out = run_miles(
        "plugins", "--json", "--hook", "miles_register_transports", pythonpath=site, env=env
    )
    assert [p["distribution"] for p in json.loads(out.stdout)] == ["miles-testplugin"]
    text = run_miles("plugins", pythonpath=site, env=env)
    assert "miles-testplugin 1.2.3" in text.stdout and "transport: tbroadcast" in text.stdout
    bad = run_miles("plugins", "--hook", "miles_nope", pythonpath=site, env=env)
    assert bad.returncode == 2 and "no hook 'miles_nope'" in bad.stderr


def test_trace_prints_every_hook_call(make_dist):
    site = make_dist("miles-testplugin", "miles_testplugin", TESTPLUGIN)
    out = run_miles(
        "plugins", pythonpath=site, env={"MILES_PLUGINS": "miles-testplugin", "MILES_TRACE": "1"}
    )
    assert out.returncode == 0
    assert "miles_register_transports" in out.stderr
    assert "finish miles_register_transports" in out.stderr


def test_autoload_switch_loads_no_entry_points(make_dist):
    site = make_dist("miles-broken", "miles_broken", BROKEN)
    out = run_miles("plugins", "--json", pythonpath=site, env={"MILES_NO_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0
    assert {p["distribution"] for p in json.loads(out.stdout)} == {"miles-core"}
