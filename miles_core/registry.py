"""The registry: every registered component, by kind and name, with who registered it."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from miles_core.components import Component, Kind, TrainerBackend
from miles_core.errors import MilesUserError, PluginError, UnknownComponentError

_Record = TypeVar("_Record", bound=Component)


class PluginInfo(Protocol):
    """Who registered a component: what the registry keeps and names in its errors
    (:class:`miles_core.plugins.PluginInfo` is one)."""

    @property
    def name(self) -> str:
        """The plugin's (entry point's) name."""

    @property
    def distribution(self) -> str:
        """The distribution that ships it."""


@dataclass
class Registry:
    """Components by kind and name. Names are unique within a kind."""

    _by_kind: dict[Kind, dict[str, tuple[Component, PluginInfo]]] = field(
        default_factory=lambda: {k: {} for k in Kind}
    )

    def add(self, component: Component, info: PluginInfo) -> None:
        """Add a component; a duplicate name within its kind is an error naming both owners."""
        table = self._by_kind[component.kind]
        if component.name in table:
            first = table[component.name][1]
            raise PluginError(
                f"{component.kind.label} {component.name!r} is registered twice: by plugin "
                f"{first.name!r} of distribution {first.distribution!r} and by plugin "
                f"{info.name!r} of distribution {info.distribution!r}; block one of them "
                "with MILES_BLOCK_PLUGINS"
            )
        table[component.name] = (component, info)

    def names(self, kind: Kind) -> list[str]:
        """Registered names of a kind, in registration order."""
        return list(self._by_kind[kind])

    def get(self, kind: Kind, name: str) -> Component:
        """The component ``name`` of ``kind``, or an error listing what is installed."""
        try:
            return self._by_kind[kind][name][0]
        except KeyError:
            raise UnknownComponentError(self.unknown_message(kind, name)) from None

    def record(self, cls: type[_Record], name: str) -> _Record:
        """The component ``name`` of ``cls``'s kind, typed as ``cls`` (the plugin manager
        admits only records of the kind's class), or an error listing what is installed."""
        component = self.get(cls.kind, name)
        if not isinstance(component, cls):
            raise PluginError(
                f"{cls.kind.label} {name!r} is a {type(component).__name__}, "
                f"expected {cls.__name__}"
            )
        return component

    def owner(self, kind: Kind, name: str) -> PluginInfo:
        """The plugin that registered a component."""
        return self._by_kind[kind][name][1]

    def all(self, kind: Kind) -> list[Component]:
        """Every component of a kind."""
        return [c for c, _ in self._by_kind[kind].values()]

    def unknown_message(self, kind: Kind, name: str) -> str:
        """``no transport 'p2pp'; installed: colocated, broadcast, p2p (did you mean 'p2p'?)``."""
        installed = self.names(kind)
        msg = f"no {kind.label} {name!r}; installed: {', '.join(installed) or 'none'}"
        close = difflib.get_close_matches(str(name), installed, n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        return msg


def build_trainer(
    registry: Registry,
    backend: str,
    options: Any,
    adapters: Sequence[tuple[str, Any]] = (),
    routing: str = "none",
    *,
    true_on_policy: bool = False,
    ranks: Any = None,
) -> Any:
    """Build trainer backend ``backend`` from its validated ``options``. With ``adapters``
    (each a registered :class:`~miles_core.components.Adapter`'s name and its validated
    options), build each adapter's object first and hand them to the backend's factory: one as
    ``factory(options, adapter=obj)``, several (a backend whose record says
    ``multi_adapter``) as ``factory(options, adapters=[obj, ...])``; without one,
    ``factory(options)``, so a backend that takes no adapter needs nothing. Every place that
    builds a run's trainer (the local run, a placement plugin's actor) goes through here.

    ``routing`` (the config's ``rollout.routing``): other than ``"none"``, it is passed on as
    ``factory(options, routing=...)`` (a backend whose record says ``routing``), and
    ``true_on_policy`` (the config's ``rollout.true_on_policy``) when True as
    ``factory(options, true_on_policy=True)`` (a backend whose record says so); ``ranks`` (a
    placement's launcher of the ranks) as ``factory(options, ranks=...)`` (a backend whose
    record says ``placed_ranks``; another is refused)."""
    record = registry.get(Kind.TRAINER_BACKEND, backend)
    kwargs: dict[str, Any] = {} if routing == "none" else {"routing": routing}
    if true_on_policy:
        kwargs["true_on_policy"] = True
    if ranks is not None:
        if not (isinstance(record, TrainerBackend) and record.placed_ranks):
            raise MilesUserError(
                f"trainer backend {backend!r} does not let a placement start its ranks "
                "(its record does not declare placed_ranks); run it without a placement "
                "plugin, or choose a backend that does (fsdp2, megatron)"
            )
        kwargs["ranks"] = ranks
    if not adapters and not kwargs:
        return record.build(options)
    if options is None and record.config is not None:
        options = record.config()
    objs = [registry.get(Kind.ADAPTER, name).build(opts) for name, opts in adapters]
    if len(objs) == 1:
        kwargs["adapter"] = objs[0]
    elif objs:
        kwargs["adapters"] = objs
    return record.load()(options, **kwargs)


def build_engine(registry: Registry, engine: str, options: Any, *, true_on_policy: bool) -> Any:
    """Build rollout engine ``engine``'s launcher from its validated ``options``: as
    ``factory(options)``, or with the config's ``rollout.true_on_policy`` as
    ``factory(options, true_on_policy=True)`` (an engine with the ``true_on_policy``
    capability starts its servers with the batch-invariant kernels)."""
    record = registry.get(Kind.ROLLOUT_ENGINE, engine)
    if not true_on_policy:
        return record.build(options)
    if options is None and record.config is not None:
        options = record.config()
    return record.load()(options, true_on_policy=True)
