"""The one compatibility checker: every selected part's declarations, and every feature's.

Each selected record declares what it requires of the run's selections (``requires``,
``excludes``, ``check``), what it offers and what it needs of the other parts
(:meth:`~miles_core.components.Component.offers`, :meth:`~miles_core.components.Component.wants`,
:class:`~miles_core.capabilities.Need`); the run config's features add needs of their own
(:mod:`miles_core.config.features`). :func:`check_compatibility` walks them all and refuses the
combination with every unmet one, naming the field, the part and the installed parts that fit.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_core.capabilities import ROLES, Need
from miles_core.components import Component, Kind
from miles_core.config.features import BY_NAME, FEATURES, Feature
from miles_core.config.schema import RunConfig
from miles_core.errors import IncompatibleError
from miles_core.registry import Registry


@dataclass(frozen=True)
class _Role:
    """How a :class:`Need`'s role finds its part in a run config, and how a problem names it."""

    kind: Kind
    pick: Callable[[RunConfig], str | None]  # the selected name; None: nothing selected
    who: str  # template over ``name``
    noun: str  # "engine": "the engine capabilities [...]"
    plural: str  # "engines that do: ..."


def _teacher_engine(config: RunConfig) -> str | None:
    if config.teacher is None:
        return None
    return (config.teacher.engine or config.engine).name


_PARTS: dict[str, _Role] = {
    "backend": _Role(
        Kind.TRAINER_BACKEND,
        lambda c: c.backend.name,
        "trainer backend {name!r} (backend.name)",
        "trainer backend",
        "backends",
    ),
    "engine": _Role(
        Kind.ROLLOUT_ENGINE,
        lambda c: c.engine.name,
        "engine {name!r} (engine.name)",
        "engine",
        "engines",
    ),
    "transport": _Role(
        Kind.TRANSPORT,
        lambda c: c.transport.name,
        "transport {name!r} (transport.name)",
        "transport",
        "transports",
    ),
    "algorithm": _Role(
        Kind.ALGORITHM, lambda c: c.algorithm.name, "algorithm {name!r}", "algorithm", "algorithms"
    ),
    "adapter": _Role(
        Kind.ADAPTER,
        lambda c: c.adapter.name if c.adapter is not None else None,
        "adapter {name!r} (adapter.name)",
        "adapter",
        "adapters",
    ),
    "schedule": _Role(
        Kind.SCHEDULE, lambda c: c.run.mode, "run.mode {name!r}", "schedule", "schedules"
    ),
    "teacher.engine": _Role(
        Kind.ROLLOUT_ENGINE, _teacher_engine, "engine {name!r}", "engine", "engines"
    ),
}
assert set(_PARTS) == set(ROLES), "every role a need may name is resolved"

_DEFAULT_SAYS = (
    "{by} needs the {noun} capabilities {missing}, which {noun} {name!r} does not serve "
    "(it serves: {has})"
)


def check_compatibility(
    config: RunConfig, registry: Registry, *, source: str | None = None
) -> None:
    """Refuse combinations that cannot run, with the reason and who declared it."""
    on = {f.name: f.value(config) for f in FEATURES}
    problems: list[str] = []
    for feature in FEATURES:
        if on[feature.name]:
            problems.extend(_feature_problems(feature, on, config, registry))
    for component in _components(config, registry):
        problems.extend(_component_problems(component, on, config, registry))
    if problems:
        raise IncompatibleError(problems, source=source)


def _feature_problems(
    feature: Feature, on: dict[str, Any], config: RunConfig, registry: Registry
) -> list[str]:
    """A feature that is on: its needs, the features it excludes, its value-level rule."""
    value = on[feature.name]
    label = feature.label.format(value=value)
    problems = []
    for need in feature.needs:
        line = _unmet(need, "", value, config, registry)
        if line:
            problems.append(f"{need.at or label}: {line}" if (need.at or label) else line)
    for other, why in feature.excludes.items():
        if on.get(other):
            problems.append(f"{label}: {why}")
    if feature.check is not None:
        problems.extend(feature.check(config, registry))
    return problems


def _component_problems(
    component: Component, on: dict[str, Any], config: RunConfig, registry: Registry
) -> list[str]:
    """What one selected part declares: slots it requires or excludes, its value-level
    rule, the features it cannot run without and what it needs of the other parts."""
    who = f"{component.kind.label} {component.name!r}"
    selected = config.selected()
    problems = []
    for slot, allowed in component.requires.items():
        have = selected.get(slot, [])
        if not any(n in allowed for n in have):
            problems.append(
                f"{who} requires {slot} in {{{', '.join(allowed)}}}; "
                f"the config selects {', '.join(have) or 'none'}"
            )
    for slot, banned in component.excludes.items():
        clash = [n for n in selected.get(slot, []) if n in banned]
        if clash:
            problems.append(f"{who} cannot run with {slot} {', '.join(clash)}")
    if component.check is not None:
        reason = component.check(config)
        if reason:
            problems.append(f"{who}: {reason}")
    for name in sorted(component.run_features()):
        feature = BY_NAME.get(name)
        if feature is None:
            problems.append(f"{who} needs the run feature {name!r}, which the core does not know")
        elif not on[name]:
            problems.append(feature.missing.format(by=who))
    for need in component.wants():
        if need.when and not on.get(need.when):
            continue
        line = _unmet(need, who, on.get(need.when), config, registry)
        if line:
            problems.append(f"{need.at}: {line}" if need.at else line)
    return problems


def _unmet(need: Need, by: str, value: Any, config: RunConfig, registry: Registry) -> str:
    """The problem line of ``need`` when the part its role selects lacks a capability, with
    the installed parts that have them all; empty when it is met or nothing is selected."""
    role = _PARTS[need.role]
    name = role.pick(config)
    if name is None:
        return ""
    part = registry.get(role.kind, name)
    offers = part.offers()
    missing = sorted(need.capabilities - offers)
    if not missing:
        return ""
    able = sorted(c.name for c in registry.all(role.kind) if need.capabilities <= c.offers())
    has = sorted(offers & need.among if need.among else offers)
    text = (need.says or _DEFAULT_SAYS).format(
        by=by,
        name=name,
        who=role.who.format(name=name),
        noun=role.noun,
        missing=missing,
        missing_names=", ".join(missing),
        has=", ".join(has) or "none",
        value=value,
    )
    heading = need.able or f"{role.plural} that do"
    return f"{text}; {heading}: {', '.join(able) or _none(missing, role.kind, registry)}"


def _none(missing: list[str], kind: Kind, registry: Registry) -> str:
    """Says none is installed, naming the closest name an installed part offers: capability
    names are open, so a misspelt one is only caught here."""
    known = sorted({n for c in registry.all(kind) for n in c.offers()})
    close = [m for n in missing for m in difflib.get_close_matches(n, known, n=1)]
    return f"none installed (did you mean {close[0]!r}?)" if close else "none installed"


def _components(config: RunConfig, registry: Registry) -> list[Component]:
    """Every selected part once, in the order the config selects them."""
    out: dict[tuple[Kind, str], Component] = {}
    for slot, names in config.selected().items():
        if slot in ("mode", "placement"):
            continue
        for name in names:
            out.setdefault((Kind(slot), name), registry.get(Kind(slot), name))
    return list(out.values())
