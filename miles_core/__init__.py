"""Miles: reinforcement-learning post-training for large language models, as a tiny core of
contracts plus plugins.

``import miles_core`` is cheap: it imports no torch, no engine and no plugin, and selects no
device. Plugins implement the hooks of :mod:`miles_core.hookspecs` with :data:`hookimpl`.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Decorator marking a function as a Miles hook implementation.
hookimpl = pluggy.HookimplMarker("miles")

from miles_core.components import (  # noqa: E402  (hookimpl first: plugins import it from here)
    Adapter,
    Algorithm,
    Component,
    DataSource,
    GroupFilter,
    Kind,
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
)
from miles_core.data import Group, Sample  # noqa: E402
from miles_core.errors import ConfigError, MilesUserError, PluginError  # noqa: E402
from miles_core.ledger import Ledger  # noqa: E402

__all__ = [
    "Adapter",
    "Algorithm",
    "Component",
    "ConfigError",
    "DataSource",
    "Group",
    "GroupFilter",
    "Kind",
    "Ledger",
    "LossFunction",
    "MetricSink",
    "MilesUserError",
    "Modality",
    "ModelFamily",
    "PluginError",
    "RewardFunction",
    "RolloutEngine",
    "RolloutFunction",
    "Router",
    "Sample",
    "SampleFilter",
    "Schedule",
    "TrainerBackend",
    "Transport",
    "__version__",
    "hookimpl",
]
