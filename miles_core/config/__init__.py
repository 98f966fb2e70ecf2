"""The run config: one YAML file, validated against the schema the selected plugins contribute.

Validation has two phases. The core's own sections (``run``, ``model``, ``rollout``, ``buffer``,
``plugins``) have fixed schemas. Each *selection* (``backend``, ``algorithm``, ``transport``...)
names a registered component and carries that component's options, which are validated by the
component's own pydantic model. Every problem is reported at once, one line each, with the
field's path and what is allowed. Then the selected components' compatibility declarations are
checked, so an impossible combination is refused before any work starts.

One module per job: :mod:`~miles_core.config.schema` (the sections and :class:`RunConfig`),
:mod:`~miles_core.config.loading` (YAML and ``--set`` overrides),
:mod:`~miles_core.config.formatting` (error lines), :mod:`~miles_core.config.validation`,
:mod:`~miles_core.config.features` and :mod:`~miles_core.config.compatibility` (what a
combination needs, and the one checker), :mod:`~miles_core.config.export` (the JSON schema).
"""

from __future__ import annotations

from miles_core.config.compatibility import check_compatibility
from miles_core.config.export import json_schema
from miles_core.config.features import eval_rollout_function, moe_layers, rollout_function_name
from miles_core.config.formatting import format_validation_error
from miles_core.config.loading import (
    MAX_YAML_NODES,
    YamlExpansionError,
    apply_overrides,
    load_yaml,
    read_config,
)
from miles_core.config.schema import (
    ADAPTER_ENTRY_KEYS,
    ADAPTER_NAME,
    SELECTIONS,
    TOP_LEVEL_KEYS,
    AdapterEntry,
    BufferSection,
    EvalSection,
    FiltersSection,
    MetricsSection,
    ModelSection,
    PluginsSection,
    RolloutSection,
    RunConfig,
    RunSection,
    Selection,
    TeacherSection,
    TracesSection,
)
from miles_core.config.validation import validate_config
from miles_core.errors import ConfigError, IncompatibleError

__all__ = [
    "ADAPTER_ENTRY_KEYS",
    "ADAPTER_NAME",
    "MAX_YAML_NODES",
    "SELECTIONS",
    "TOP_LEVEL_KEYS",
    "AdapterEntry",
    "BufferSection",
    "ConfigError",
    "EvalSection",
    "FiltersSection",
    "IncompatibleError",
    "MetricsSection",
    "ModelSection",
    "PluginsSection",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "Selection",
    "TeacherSection",
    "TracesSection",
    "YamlExpansionError",
    "apply_overrides",
    "check_compatibility",
    "eval_rollout_function",
    "format_validation_error",
    "json_schema",
    "load_yaml",
    "moe_layers",
    "read_config",
    "rollout_function_name",
    "validate_config",
]
