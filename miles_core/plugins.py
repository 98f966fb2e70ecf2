"""The plugin manager: loads the core's default plugins and the ``miles`` entry points.

Loading is loud: a plugin that fails to import, implements an unknown hook, or registers a
duplicate name is a :class:`~miles_core.errors.PluginError` naming its distribution. Users
choose what loads with environment variables (or the run config's ``plugins`` section):

* ``MILES_PLUGINS`` — allow-list: comma-separated distribution or entry-point names; only
  these load.
* ``MILES_BLOCK_PLUGINS`` — block-list: these are skipped.
* ``MILES_NO_PLUGIN_AUTOLOAD=1`` — load no entry points at all (the default plugins still load).
* ``MILES_TRACE=1`` — print every hook call with its arguments and results to stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any, TextIO

import pluggy

from miles_core import hookspecs
from miles_core.components import COMPONENT_CLASSES, Component, Kind
from miles_core.errors import PluginError
from miles_core.hooks import Hooks
from miles_core.registry import Registry

ENTRY_POINT_GROUP = "miles"
CORE_DISTRIBUTION = "miles-core"

#: The core's own features, registered through the same hooks as third-party plugins.
DEFAULT_PLUGINS = (
    "miles_core.builtins.modalities",
    "miles_core.builtins.rewards",
    "miles_core.builtins.rollouts",
    "miles_core.builtins.sft",
    "miles_core.builtins.filters",
    "miles_core.builtins.data_sources",
    "miles_core.builtins.conversations",
    "miles_core.builtins.reasoning_gym",
    "miles_core.builtins.metric_sinks",
    "miles_core.builtins.schedules",
)


@dataclass
class PluginInfo:
    """Where a loaded plugin came from and what it provides."""

    name: str
    distribution: str
    version: str
    module: str
    hooks: list[str] = field(default_factory=list)
    registers: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary used by ``miles plugins --json``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "hooks": sorted(self.hooks),
            "registers": {k: sorted(v) for k, v in sorted(self.registers.items())},
        }


def _split(value: str | None) -> set[str]:
    return {v.strip() for v in (value or "").split(",") if v.strip()}


def _core_version() -> str:
    from miles_core import __version__

    return __version__


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``miles`` project, remembering each plugin's provenance."""

    def __init__(self) -> None:
        super().__init__("miles")
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}

    def register_plugin(
        self, plugin: object, *, name: str, distribution: str, version: str
    ) -> PluginInfo:
        """Register ``plugin`` under ``name``, wrapping pluggy's validation errors so they name
        the distribution."""
        if name in self.infos:
            other = self.infos[name].distribution
            raise PluginError(
                f"plugin name {name!r} of distribution {distribution!r} is already used by "
                f"distribution {other!r}; rename one of the entry points"
            )
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {name!r} of distribution {distribution!r} {version} is invalid: {exc}"
            ) from None
        # a module registered through an entry point, or an object registered by a test
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__name__
        info = PluginInfo(name=name, distribution=distribution, version=version, module=module)
        info.hooks = [impl.name for impl in self.get_hookcallers(plugin) or []]
        self.infos[name] = info
        return info

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered with :meth:`register_plugin`."""
        self.unregister(name=name)
        self.infos.pop(name, None)

    def check(self) -> None:
        """Fail if any plugin implements a hook that no spec declares (pluggy's check_pending)."""
        for hook_name in dir(self.hook):
            if hook_name.startswith("_"):
                continue
            caller = getattr(self.hook, hook_name)
            if caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                info = self.infos.get(impl.plugin_name)
                dist = info.distribution if info else "unknown"
                known = ", ".join(sorted(n for n in dir(self.hook) if n.startswith("miles_")))
                raise PluginError(
                    f"plugin {impl.plugin_name!r} of distribution {dist!r} implements unknown "
                    f"hook {hook_name!r}; known hooks: {known}"
                )

    def enable_trace(self, stream: TextIO | None = None) -> Callable[[], None]:
        """Print every hook call with its arguments and results; returns an undo function."""
        out = stream or sys.stderr
        self.trace.root.setwriter(out.write)
        return self.enable_tracing()


def _selected(ep: EntryPoint, allow: set[str], block: set[str]) -> bool:
    dist = ep.dist.name if ep.dist else ""
    names = {ep.name, dist}
    if names & block:
        return False
    return not allow or bool(names & allow)


def load_entry_point(pm: PluginManager, ep: EntryPoint) -> PluginInfo:
    """Import one entry point and register it; any failure names the distribution."""
    dist = ep.dist.name if ep.dist else "unknown"
    version = ep.dist.version if ep.dist else "unknown"
    try:
        plugin = ep.load()
    except Exception as exc:  # any import failure of a third-party plugin is the user's to fix
        raise PluginError(
            f"plugin {ep.name!r} of distribution {dist!r} {version} failed to import "
            f"({type(exc).__name__}: {exc}). Fix or uninstall it, or skip it with "
            f"MILES_BLOCK_PLUGINS={dist}"
        ) from None
    return pm.register_plugin(plugin, name=ep.name, distribution=dist, version=version)


def create_plugin_manager(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    block: Iterable[str] | None = None,
    trace: bool | None = None,
) -> PluginManager:
    """Create a manager with the default plugins and, unless disabled, the entry points.

    Arguments default to the environment (see the module docstring); explicit lists are merged
    with the environment's.
    """
    pm = PluginManager()
    env = os.environ
    if trace is None:
        trace = env.get("MILES_TRACE", "") not in ("", "0")
    if trace:
        pm.enable_trace()
    for module_name in DEFAULT_PLUGINS:
        module: ModuleType = import_module(module_name)
        pm.register_plugin(
            module,
            name=f"miles.{module_name.rsplit('.', 1)[-1]}",
            distribution=CORE_DISTRIBUTION,
            version=_core_version(),
        )
    if autoload is None:
        autoload = env.get("MILES_NO_PLUGIN_AUTOLOAD", "") in ("", "0")
    if autoload:
        allow_set = _split(env.get("MILES_PLUGINS")) | set(allow or ())
        block_set = _split(env.get("MILES_BLOCK_PLUGINS")) | set(block or ())
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if _selected(ep, allow_set, block_set):
                load_entry_point(pm, ep)
    pm.check()
    return pm


def collect_registry(pm: PluginManager) -> Registry:
    """Call every registration hook plugin by plugin, so each record knows who registered it."""
    registry = Registry()
    for info in pm.infos.values():
        info.registers = {}
    for kind in Kind:
        caller = getattr(pm.hook, kind.hook)
        for impl in caller.get_hookimpls():
            if impl.plugin_name not in pm.infos:  # plain pm.register: give it a provenance
                pm.infos[impl.plugin_name] = PluginInfo(
                    impl.plugin_name, "unknown", "unknown", impl.plugin_name
                )
            info = pm.infos[impl.plugin_name]
            others = [p for p in pm.get_plugins() if p is not impl.plugin]
            subset = pm.subset_hook_caller(kind.hook, remove_plugins=others)
            subset(register=_registrar(registry, kind, info))
    return registry


def _registrar(registry: Registry, kind: Kind, info: PluginInfo) -> Callable[[Component], None]:
    expected = COMPONENT_CLASSES[kind]

    def register(component: Component) -> None:
        if not isinstance(component, expected):
            raise PluginError(
                f"plugin {info.name!r} of distribution {info.distribution!r} passed "
                f"{type(component).__name__} to {kind.hook}; expected {expected.__name__}"
            )
        registry.add(component, info)
        info.registers.setdefault(kind.value, []).append(component.name)

    return register


@dataclass
class Plugins:
    """Everything a command or a run needs from the plugin system: the manager, the registry of
    components and the typed hook facade."""

    pm: PluginManager
    registry: Registry

    @property
    def hooks(self) -> Hooks:
        """Typed facade over the lifecycle hooks."""
        return Hooks(self.pm)


def load_plugins(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    block: Iterable[str] | None = None,
    trace: bool | None = None,
) -> Plugins:
    """Create the plugin manager and collect the registry (see :func:`create_plugin_manager`)."""
    pm = create_plugin_manager(autoload=autoload, allow=allow, block=block, trace=trace)
    return Plugins(pm=pm, registry=collect_registry(pm))
