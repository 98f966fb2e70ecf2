"""pytest fixtures for plugin authors (loaded automatically through the ``pytest11`` entry point).

* ``miles_pm`` — a fresh plugin manager with the core's default plugins only: installed
  plugins never leak into a test.
* ``miles_register`` — register an in-test plugin (a module or object with ``@hookimpl``
  functions) on ``miles_pm`` for the duration of the test.
* ``miles_registry`` — call it to collect the registry of ``miles_pm`` as it is now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from miles_core.plugins import PluginManager, collect_registry, create_plugin_manager
from miles_core.registry import Registry


@pytest.fixture
def miles_pm() -> PluginManager:
    """A fresh plugin manager with the default plugins and no entry points."""
    return create_plugin_manager(autoload=False, trace=False)


@pytest.fixture
def miles_register(miles_pm: PluginManager) -> Iterator[Callable[..., Any]]:
    """Register in-test plugins on ``miles_pm``; each is unregistered after the test."""
    names: list[str] = []

    def register(
        plugin: object, *, name: str = "test-plugin", distribution: str = "test-distribution"
    ) -> object:
        miles_pm.register_plugin(plugin, name=name, distribution=distribution, version="0")
        miles_pm.check()
        names.append(name)
        return plugin

    yield register
    for name in names:
        if name in miles_pm.infos:
            miles_pm.unregister_plugin(name)


@pytest.fixture
def miles_registry(miles_pm: PluginManager) -> Callable[[], Registry]:
    """Returns a function collecting the registry of ``miles_pm`` as it is now."""
    return lambda: collect_registry(miles_pm)
