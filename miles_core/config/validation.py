"""Validating a run config: every selection checked against the registry's records, every
problem reported at once, one line each, then the combination checked
(:mod:`miles_core.config.compatibility`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from miles_core.components import Algorithm, Kind
from miles_core.config.compatibility import check_compatibility
from miles_core.config.formatting import format_validation_error
from miles_core.config.schema import (
    _DEFAULT_SINKS,
    _PLAIN_SECTIONS,
    _SECTION_SELECTIONS,
    ADAPTER_ENTRY_KEYS,
    ADAPTER_NAME,
    SELECTIONS,
    TOP_LEVEL_KEYS,
    AdapterEntry,
    EvalSection,
    FiltersSection,
    MetricsSection,
    ModelSection,
    RunConfig,
    Selection,
    TeacherSection,
    _SelectionSpec,
)
from miles_core.errors import ConfigError, MilesUserError
from miles_core.registry import Registry


def _normalise_selection(value: Any, path: str, problems: list[str]) -> dict[str, Any] | None:
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict):
        if "name" not in value:
            problems.append(f"{path}.name: required field missing")
            return None
        if not isinstance(value["name"], str):
            problems.append(f"{path}.name: must be a string (got {json.dumps(value['name'])})")
            return None
        return dict(value)
    problems.append(
        f"{path}: expected a name or a mapping with 'name' and options "
        f"(got {json.dumps(value, default=str)})"
    )
    return None


def _select(
    value: Any, path: str, kind: Kind, registry: Registry, problems: list[str]
) -> Selection | None:
    data = _normalise_selection(value, path, problems)
    if data is None:
        return None
    name = data.pop("name")
    try:
        component = registry.get(kind, name)
    except MilesUserError as exc:
        problems.append(f"{path}.name: {exc}")
        return None
    if component.config is None:
        if data:
            problems.append(
                f"{path}: {kind.label} {name!r} takes no options (got {', '.join(data)})"
            )
            return None
        return Selection(name=name)
    try:
        options = component.config.model_validate(data)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, path, component.config))
        return None
    return Selection(name=name, options=options)


def validate_config(
    raw: Mapping[str, Any], registry: Registry, *, source: str | None = None
) -> RunConfig:
    """Validate raw config data against the registry; raise :class:`ConfigError` listing every
    problem, then :class:`IncompatibleError` if the selections cannot run together."""
    if not isinstance(raw, Mapping):
        raise ConfigError(["the top level must be a mapping of sections"], source=source)
    problems = [
        f"unknown section {key!r}; allowed: {', '.join(TOP_LEVEL_KEYS)}"
        for key in raw
        if key not in TOP_LEVEL_KEYS
    ]
    parts = _plain_sections(raw, problems)
    parts.update(_sections_with_selections(raw, registry, problems))
    groups = _selections(raw, registry, problems, parts)
    _defaults(raw, registry, problems, parts)
    parts["adapters"] = entries = _adapter_entries(raw, registry, problems)
    for key in ("data", "reward"):  # each adapter names its own: the run's is the first's
        if parts.get(key) is None and entries and _every_adapter_has(raw, key):
            parts[key] = getattr(entries[0], key)
    if problems:
        raise ConfigError(problems, source=source)
    config = RunConfig(
        **parts,
        filters=FiltersSection(**groups["filters"]),
        metrics=MetricsSection(**groups["metrics"]),
    )
    check_compatibility(config, registry, source=source)
    return config


def _plain_sections(raw: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """The core's sections without selections (``run``, ``rollout``, ``buffer``,
    ``plugins``), defaults when absent."""
    parts: dict[str, Any] = {}
    for key, model in _PLAIN_SECTIONS.items():
        value = raw.get(key, {})
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            problems.append(f"{key}: expected a mapping (got {json.dumps(value, default=str)})")
            continue
        try:
            parts[key] = model.model_validate(value)
        except ValidationError as exc:
            problems.extend(format_validation_error(exc, key, model))
    return parts


#: Plain sections that hold selections (model.family; eval.data...): each with its model and
#: what an absent one is: ``"required"``, ``"defaults"`` (the model's defaults) or ``"none"``.
_SECTIONS: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("model", ModelSection, "required"),
    ("eval", EvalSection, "defaults"),
    ("teacher", TeacherSection, "none"),
)


def _sections_with_selections(
    raw: Mapping[str, Any], registry: Registry, problems: list[str]
) -> dict[str, Any]:
    """``model``, ``eval`` and ``teacher``: plain fields plus the selections inside them."""
    parts: dict[str, Any] = {}
    for key, model, absent in _SECTIONS:
        section_raw = raw.get(key)
        if section_raw is None:
            if absent == "required":
                problems.append(f"{key}: required section missing (needs at least 'path')")
            else:
                parts[key] = model.model_validate({}) if absent == "defaults" else None
            continue
        if not isinstance(section_raw, Mapping):
            problems.append(
                f"{key}: expected a mapping (got {json.dumps(section_raw, default=str)})"
            )
            continue
        subs = dict(_SECTION_SELECTIONS[key])
        rest = {k: v for k, v in section_raw.items() if k not in subs}
        picked: dict[str, Selection | None] = {}
        for sub, kind in subs.items():
            sel_raw = section_raw.get(sub)
            picked[sub] = None
            if sel_raw is not None:
                picked[sub] = _select(sel_raw, f"{key}.{sub}", kind, registry, problems)
        try:
            parts[key] = model.model_validate({**rest, **dict.fromkeys(subs)})
            for sub, selection in picked.items():
                setattr(parts[key], sub, selection)
        except ValidationError as exc:
            problems.extend(format_validation_error(exc, key, model))
    return parts


def _selections(
    raw: Mapping[str, Any], registry: Registry, problems: list[str], parts: dict[str, Any]
) -> dict[str, dict[str, list[Selection]]]:
    """The top-level selections into ``parts``; returns the lists of ``filters`` and
    ``metrics`` by section and key."""
    groups: dict[str, dict[str, list[Selection]]] = {"filters": {}, "metrics": {}}
    for spec in SELECTIONS:
        if spec.key in _SECTION_SELECTIONS:
            continue
        if spec.many:
            chosen = _many(raw, spec, registry, problems)
            if chosen is not None:
                assert spec.sub is not None
                groups[spec.key][spec.sub] = chosen
            continue
        value = raw.get(spec.key, spec.default)
        if value is None:
            if spec.required and not _every_adapter_has(raw, spec.key):
                installed = ", ".join(registry.names(spec.kind)) or "none"
                article = "an" if spec.kind.label[0] in "aeiou" else "a"
                problems.append(
                    f"{spec.key}: required section missing; choose {article} {spec.kind.label} "
                    f"(installed: {installed})"
                )
            else:
                parts[spec.key] = None
            continue
        parts[spec.key] = _select(value, spec.key, spec.kind, registry, problems)
    return groups


def _many(
    raw: Mapping[str, Any], spec: _SelectionSpec, registry: Registry, problems: list[str]
) -> list[Selection] | None:
    """A list of selections (``filters.group``, ``metrics.sinks``); ``None`` when malformed."""
    section = raw.get(spec.key) or {}
    if not isinstance(section, Mapping):
        problems.append(f"{spec.key}: expected a mapping with '{spec.sub}'")
        return None
    allowed_sub = sorted(str(s.sub) for s in SELECTIONS if s.key == spec.key)
    for k in section:
        if k not in allowed_sub:
            problems.append(f"{spec.key}: unknown key {k!r}; allowed: {', '.join(allowed_sub)}")
    items = section.get(spec.sub)
    if items is None and spec.kind is Kind.METRIC_SINK:
        items = [n for n in _DEFAULT_SINKS if n in registry.names(Kind.METRIC_SINK)]
    items = items or []
    if not isinstance(items, list):
        problems.append(f"{spec.key}.{spec.sub}: expected a list")
        return None
    chosen = []
    for i, item in enumerate(items):
        s = _select(item, f"{spec.key}.{spec.sub}[{i}]", spec.kind, registry, problems)
        if s is not None:
            chosen.append(s)
    return chosen


def _defaults(
    raw: Mapping[str, Any], registry: Registry, problems: list[str], parts: dict[str, Any]
) -> None:
    """Selections the config may leave out: the router, the algorithm's rollout function; and
    the schedule ``run.mode`` names."""
    # One installed router is the default (it routes only when a run has several engines);
    # `router: null` routes directly, one engine per route.
    routers = registry.names(Kind.ROUTER)
    if "router" not in raw and len(routers) == 1:
        parts["router"] = _select(routers[0], "router", Kind.ROUTER, registry, problems)
    # An algorithm may name the rollout function it is meant for (sft: conversations from
    # data); it is the default when the config names none.
    algorithm = parts.get("algorithm")
    if parts.get("rollout_function") is None and raw.get("rollout_function") is None and algorithm:
        name = registry.record(Algorithm, algorithm.name).default_rollout_function
        if name and name not in registry.names(Kind.ROLLOUT_FUNCTION):
            problems.append(
                f"rollout_function: algorithm {algorithm.name!r} runs with rollout function "
                f"{name!r} by default, which is not installed; name one in rollout_function"
            )
        elif name:
            parts["rollout_function"] = _select(
                name, "rollout_function", Kind.ROLLOUT_FUNCTION, registry, problems
            )
    if "run" in parts:
        mode, schedules = parts["run"].mode, registry.names(Kind.SCHEDULE)
        if mode not in schedules:
            problems.append(
                f"run.mode: unknown schedule {mode!r}; allowed: {', '.join(schedules) or 'none'}"
            )


def _every_adapter_has(raw: Mapping[str, Any], key: str) -> bool:
    """Whether the config lists ``adapters`` and each names its own ``key`` (``data``,
    ``reward``), so the run needs none of its own."""
    items = raw.get("adapters")
    return (
        isinstance(items, list)
        and bool(items)
        and all(isinstance(i, Mapping) and i.get(key) is not None for i in items)
    )


def _adapter_entries(
    raw: Mapping[str, Any], registry: Registry, problems: list[str]
) -> list[AdapterEntry]:
    """The ``adapters`` list: each entry's adapter options laid over the run's ``adapter``
    selection, its own data, reward and evaluation data validated as the run's are."""
    items = raw.get("adapters")
    if items is None:
        return []
    if not isinstance(items, list) or not items:
        problems.append("adapters: expected a non-empty list of {name, options, data, ...}")
        return []
    base = _normalise_selection(raw.get("adapter"), "adapter", []) if raw.get("adapter") else None
    if base is None:
        problems.append(
            "adapters: needs an adapter section naming the kind of adapter and the options the "
            "adapters share (adapter: {name: lora, rank: 8, ...})"
        )
        return []
    kind = base.pop("name")
    entries: list[AdapterEntry] = []
    names: set[str] = set()
    for i, item in enumerate(items):
        path = f"adapters[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            problems.append(f"{path}: expected a mapping with a string 'name' (the served name)")
            continue
        unknown = [k for k in item if k not in ADAPTER_ENTRY_KEYS]
        if unknown:
            problems.append(
                f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(ADAPTER_ENTRY_KEYS)}"
            )
            continue
        name = item["name"]
        if not re.match(ADAPTER_NAME, name):
            problems.append(
                f"{path}.name: {name!r} is not a served name (letters, digits, '_' and '-', "
                "at most 64): it names the adapter on the engines and its folder"
            )
            continue
        if name in names:
            problems.append(f"{path}.name: {name!r} is named twice; each adapter's is its own")
            continue
        names.add(name)
        options = item.get("options") or {}
        if not isinstance(options, Mapping):
            problems.append(f"{path}.options: expected a mapping of {kind!r} options")
            continue
        if options.get("served_name", name) != name:
            problems.append(f"{path}.options.served_name: the served name is {path}.name")
            continue
        merged = {"name": kind, **base, **options, "served_name": name}
        selection = _select(merged, f"{path}.options", Kind.ADAPTER, registry, problems)
        picked = {
            key: _select(item[key], f"{path}.{key}", k, registry, problems)
            if item.get(key) is not None
            else None
            for key, k in (
                ("data", Kind.DATA_SOURCE),
                ("reward", Kind.REWARD_FUNCTION),
                ("eval_data", Kind.DATA_SOURCE),
            )
        }
        if selection is not None:
            entries.append(
                AdapterEntry(
                    name=name, adapter=selection, output_dir=item.get("output_dir"), **picked
                )
            )
    return entries
