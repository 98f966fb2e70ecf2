"""The runtime interfaces that the objects built by components implement.

A component record (:mod:`miles_core.components`) says *what* a plugin provides; the protocols
here say *how the loop talks to it*. They are structural (``typing.Protocol``): a plugin needs
no base class. Tensor types are named as strings so this package, like the whole core, imports
no torch. Each kind's contract tests live in :mod:`miles_core.testing.contracts`.

One module per job: :mod:`~miles_core.contracts.extensions` (rewards, filters, prompt
sources, metric writers, rollouts), :mod:`~miles_core.contracts.training` (algorithms, trainer
backends, adapters), :mod:`~miles_core.contracts.engines` (engines, weight transports, the
router, schedules) and :mod:`~miles_core.contracts.families` (model families). Every name is
imported from here.
"""

from __future__ import annotations

from miles_core.contracts.engines import (
    AdapterSync,
    EngineClient,
    EngineLauncher,
    Generation,
    PeerWeightsClient,
    Router,
    Schedule,
    WeightReceiver,
    WeightTransport,
)
from miles_core.contracts.extensions import (
    GroupFilterFn,
    MetricWriter,
    PromptSource,
    RewardFn,
    RolloutFn,
    SampleFilterFn,
)
from miles_core.contracts.families import Family, FamilyDefaults
from miles_core.contracts.training import (
    AdapterImpl,
    AdapterTrainer,
    AlgorithmImpl,
    LossFn,
    TokenBatch,
    Trainer,
    each_tensor_once,
)

__all__ = [
    "AdapterImpl",
    "AdapterSync",
    "AdapterTrainer",
    "AlgorithmImpl",
    "EngineClient",
    "EngineLauncher",
    "Family",
    "FamilyDefaults",
    "Generation",
    "GroupFilterFn",
    "LossFn",
    "MetricWriter",
    "PeerWeightsClient",
    "PromptSource",
    "RewardFn",
    "RolloutFn",
    "Router",
    "SampleFilterFn",
    "Schedule",
    "TokenBatch",
    "Trainer",
    "WeightReceiver",
    "WeightTransport",
    "each_tensor_once",
]
