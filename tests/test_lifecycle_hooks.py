"""Lifecycle hooks reach plugins through the typed facade, with their arguments."""

from __future__ import annotations

import pytest
import yaml
from core_support import VALID_CONFIG

from miles_core import hookimpl
from miles_core.config import RunConfig, RunSection, Selection
from miles_core.data import Group, Sample
from miles_core.hooks import Hooks


class Recorder:
    """An in-test plugin recording every lifecycle call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    @hookimpl
    def miles_configure(self, config):
        self.calls.append(("configure", {"config": config}))

    @hookimpl
    def miles_run_start(self, config, run_dir):
        self.calls.append(("run_start", {"run_dir": run_dir}))

    @hookimpl
    def miles_run_end(self, config, run_dir, status):
        self.calls.append(("run_end", {"status": status}))

    @hookimpl
    def miles_group_finished(self, group, step):
        self.calls.append(("group_finished", {"group": group.group_id, "step": step}))

    @hookimpl
    def miles_before_train_step(self, step, groups):
        self.calls.append(("before_train_step", {"step": step, "n": len(groups)}))

    @hookimpl
    def miles_after_train_step(self, step, groups, metrics):
        self.calls.append(("after_train_step", {"step": step, "metrics": dict(metrics)}))

    @hookimpl
    def miles_after_weight_sync(self, step, version, metrics):
        self.calls.append(("after_weight_sync", {"version": version}))

    @hookimpl
    def miles_metrics_emitted(self, step, metrics):
        self.calls.append(("metrics_emitted", {"step": step, "metrics": dict(metrics)}))


def _config() -> RunConfig:
    raw = yaml.safe_load(VALID_CONFIG)
    sel = {
        k: Selection(name=v if isinstance(v, str) else v["name"])
        for k, v in raw.items()
        if k not in ("run", "model")
    }
    from miles_core.config import (
        BufferSection,
        FiltersSection,
        MetricsSection,
        ModelSection,
        PluginsSection,
        RolloutSection,
    )

    return RunConfig(
        run=RunSection(),
        model=ModelSection(path="m"),
        modality=Selection(name="text"),
        rollout=RolloutSection(),
        filters=FiltersSection(),
        buffer=BufferSection(),
        metrics=MetricsSection(),
        plugins=PluginsSection(),
        **sel,
    )


@pytest.fixture
def recorder(miles_register, miles_pm):
    rec = Recorder()
    miles_register(rec, name="recorder")
    return rec, Hooks(miles_pm)


def _group() -> Group:
    s = Sample(prompt_ids=[1])
    s.append([2], logprobs=[-0.5], version=0)
    return Group(samples=[s])


def test_hook_miles_configure(recorder, miles_pm):
    rec, hooks = recorder
    config = _config()
    hooks.configure(config)
    assert rec.calls == [("configure", {"config": config})]
    late = Recorder()  # historic: a plugin registered afterwards still sees the call
    miles_pm.register(late, name="late")
    assert late.calls == [("configure", {"config": config})]


class Placed:
    """A placement plugin that placed (``records``) or did not (``None``) the run."""

    def __init__(self, records):
        self.records = records
        self.seen = []

    @hookimpl
    def miles_placement_record(self, config):
        self.seen.append(config)
        return self.records


def test_hook_miles_placement_record(miles_register, miles_pm):
    rank = {"role": "trainer_rank", "index": 0, "address": "10.0.0.2", "pid": 7}
    engine = {"role": "engine", "index": 0, "address": "10.0.0.3", "pid": 8}
    placed, other = Placed([rank, engine]), Placed(None)
    miles_register(placed, name="placed")
    miles_register(other, name="other")
    config = _config()
    # every answer's records, in one list; a plugin that did not place the run adds none
    assert Hooks(miles_pm).placement_record(config) == [rank, engine]
    assert placed.seen == [config] and other.seen == [config]


class Growing:
    """A placement plugin whose cluster has room for ``room`` more engines (``None``: not
    watching)."""

    def __init__(self, room):
        self.room = room
        self.seen = []

    @hookimpl
    def miles_engines_to_add(self, config, engines):
        self.seen.append((config, engines))
        return self.room


def test_hook_miles_engines_to_add(miles_register, miles_pm):
    two, none, one = Growing(2), Growing(None), Growing(1)
    for name, plugin in (("two", two), ("none", none), ("one", one)):
        miles_register(plugin, name=name)
    config = _config()
    # the answers summed; a plugin with nothing to say adds nothing
    assert Hooks(miles_pm).engines_to_add(config, 3) == 3
    assert two.seen == none.seen == one.seen == [(config, 3)]


def test_hook_miles_run_start(recorder):
    rec, hooks = recorder
    hooks.run_start(_config(), "runs/x")
    assert rec.calls == [("run_start", {"run_dir": "runs/x"})]


def test_hook_miles_run_end(recorder):
    rec, hooks = recorder
    hooks.run_end(_config(), "runs/x", "interrupted")
    assert rec.calls == [("run_end", {"status": "interrupted"})]


def test_hook_miles_group_finished(recorder):
    rec, hooks = recorder
    g = _group()
    hooks.group_finished(g, 3)
    assert rec.calls == [("group_finished", {"group": g.group_id, "step": 3})]


def test_hook_miles_before_train_step(recorder):
    rec, hooks = recorder
    hooks.before_train_step(2, [_group(), _group()])
    assert rec.calls == [("before_train_step", {"step": 2, "n": 2})]


def test_hook_miles_after_train_step(recorder):
    rec, hooks = recorder
    hooks.after_train_step(2, [_group()], {"loss": 0.5})
    assert rec.calls == [("after_train_step", {"step": 2, "metrics": {"loss": 0.5}})]


def test_hook_miles_after_weight_sync(recorder):
    rec, hooks = recorder
    hooks.after_weight_sync(2, 3, {"sync/seconds": 0.1})
    assert rec.calls == [("after_weight_sync", {"version": 3})]


def test_hook_miles_metrics_emitted(recorder):
    rec, hooks = recorder
    hooks.metrics_emitted(4, {"reward/mean": 1.0})
    assert rec.calls == [("metrics_emitted", {"step": 4, "metrics": {"reward/mean": 1.0}})]


def test_selection_options_are_read_from_options():
    """A selection forwards no attribute: its options are ``.options``."""
    from miles_core.builtins.rewards import LastNumberOptions

    sel = Selection(name="last_number", options=LastNumberOptions(tolerance=0.5))
    assert sel.options.tolerance == 0.5
    with pytest.raises(AttributeError):
        _ = sel.tolerance
