"""The placement hook: build_parts asks the placement plugins where the trainer, its sender and
the engines run, and refuses a disaggregated run that no plugin places."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import TESTPLUGIN, VALID_CONFIG

from miles_core import RolloutEngine, hookimpl
from miles_core.config import RunConfig, validate_config
from miles_core.errors import MilesUserError
from miles_core.plugins import Plugins, collect_registry
from miles_core.runtime.parts import build_parts


class Placer:
    """An in-test placement plugin: records its calls and answers with its own objects."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.calls: list[tuple[RunConfig, Any]] = []
        self.trainer, self.transport, self.launcher = object(), object(), object()

    @hookimpl
    def miles_place(self, config, launcher):
        self.calls.append((config, launcher))
        if not self.answer:
            return None
        return self.trainer, self.transport, self.launcher


class Launcher:
    """What the in-test engine builds: a launcher object the hook must receive."""


class Engines:
    """An in-test plugin registering an engine whose factory builds a :class:`Launcher`."""

    @hookimpl
    def miles_register_rollout_engines(self, register):
        register(RolloutEngine(name="tlauncher", factory=lambda options: Launcher()))


def _plugins(miles_pm: Any, miles_register: Any, *placers: Placer) -> Plugins:
    module = types.ModuleType("miles_testplugin")
    # pydantic resolves the options models' annotations through sys.modules
    sys.modules[module.__name__] = module
    exec(TESTPLUGIN, module.__dict__)
    miles_register(module, name="testplugin")
    miles_register(Engines(), name="engines")
    for i, placer in enumerate(placers):
        miles_register(placer, name=f"placer{i}")
    return Plugins(pm=miles_pm, registry=collect_registry(miles_pm))


def _config(plugins: Plugins, tmp_path: Path, placement: str) -> RunConfig:
    raw = yaml.safe_load(VALID_CONFIG)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 1?", "answer": 2}\n')
    raw["data"]["path"] = str(tmp_path / "prompts.jsonl")
    raw["run"]["placement"] = placement
    raw["engine"] = "tlauncher"
    if placement == "disaggregated":
        raw["transport"] = {"name": "tbroadcast"}
    return validate_config(raw, plugins.registry)


def test_hook_miles_place(miles_pm: Any, miles_register: Any, tmp_path: Path) -> None:
    placer = Placer(answer=True)
    plugins = _plugins(miles_pm, miles_register, placer)
    config = _config(plugins, tmp_path, "disaggregated")
    parts = build_parts(config, plugins)
    assert parts.trainer is placer.trainer
    assert parts.transport is placer.transport
    assert parts.launcher is placer.launcher
    # called once, with the run's config and the selected engine's launcher as built
    ((seen_config, seen_launcher),) = placer.calls
    assert seen_config is config
    assert isinstance(seen_launcher, Launcher)


def test_no_placement_builds_the_trainer_and_sender_here(
    miles_pm: Any, miles_register: Any, tmp_path: Path
) -> None:
    placer = Placer(answer=False)
    plugins = _plugins(miles_pm, miles_register, placer)
    config = _config(plugins, tmp_path, "colocated")
    parts = build_parts(config, plugins)
    assert len(placer.calls) == 1
    # the test plugin's factories return their options: built here, from the config
    assert parts.trainer == config.backend.options
    assert parts.transport == config.transport.options
    assert isinstance(parts.launcher, Launcher) and parts.launcher is placer.calls[0][1]


def test_the_first_placement_wins(miles_pm: Any, miles_register: Any, tmp_path: Path) -> None:
    first, second = Placer(answer=True), Placer(answer=True)
    plugins = _plugins(miles_pm, miles_register, first, second)
    parts = build_parts(_config(plugins, tmp_path, "colocated"), plugins)
    answered = [p for p in (first, second) if parts.trainer is p.trainer]
    assert len(answered) == 1
    assert sum(len(p.calls) for p in (first, second)) == 1  # firstresult stops at the answer


@pytest.mark.parametrize("installed", [False, True])
def test_disaggregated_without_a_placement_plugin_is_refused(
    miles_pm: Any, miles_register: Any, tmp_path: Path, installed: bool
) -> None:
    placers = (Placer(answer=False),) if installed else ()
    plugins = _plugins(miles_pm, miles_register, *placers)
    with pytest.raises(MilesUserError, match=r"run\.placement 'disaggregated'.*miles-ray"):
        build_parts(_config(plugins, tmp_path, "disaggregated"), plugins)
