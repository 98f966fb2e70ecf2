"""The built components of a run: every selected plugin's object, made once at the start."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

from miles_core.components import Kind, RolloutEngine
from miles_core.config import RunConfig, eval_rollout_function, rollout_function_name
from miles_core.contracts import AdapterSync
from miles_core.errors import MilesUserError
from miles_core.plugins import Plugins
from miles_core.registry import Registry, build_engine, build_trainer


@dataclass
class Parts:
    """The built components of a run."""

    data: Any
    reward: Any
    rollout: Any
    algorithm: Any
    trainer: Any
    launcher: Any
    transport: Any
    schedule: Any
    router: Any = None
    family: Any = None
    #: the built modality (text, diffusion): rollout functions get it as ``modality``
    modality: Any = None
    #: the rollout function the held-out evaluation generates with (the run's when it
    #: generates)
    eval_rollout: Any = None
    #: the launcher of the distillation teacher's engines (the config's ``teacher``)
    teacher_launcher: Any = None
    #: what the engines serve and the transport publishes when the run trains adapters (the
    #: config's ``adapter``, or each of ``adapters``): served name and engine config of each
    adapters: list[AdapterSync] = field(default_factory=list)
    #: each adapter's own reward function, by served name (``adapters[].reward``; the
    #: others score with ``reward``)
    rewards: dict[str, Any] = field(default_factory=dict)
    group_filters: list[Any] = field(default_factory=list)
    sample_filters: list[Any] = field(default_factory=list)
    sinks: list[Any] = field(default_factory=list)
    #: the engine capabilities the run's engine record declares
    engine_capabilities: frozenset[str] = frozenset()


class WithLoss:
    """An algorithm whose per-token loss is replaced by a user's loss function (the run
    config's ``loss``); its advantage estimator and ``needs`` stay the algorithm's."""

    def __init__(self, algorithm: Any, loss_fn: Any) -> None:
        self.algorithm = algorithm
        self.loss_fn = loss_fn
        self.needs: frozenset[str] = algorithm.needs

    def compute_advantages(self, batch: Any) -> None:
        """The algorithm's own estimator."""
        self.algorithm.compute_advantages(batch)

    def loss(self, batch: Any, logprobs: Any, **kwargs: Any) -> Any:
        """The user's loss."""
        return self.loss_fn(batch, logprobs, **kwargs)


def build_parts(config: RunConfig, plugins: Plugins) -> Parts:
    """Build every selected component from its validated options. Placement comes last: once a
    placement plugin has reserved devices and started the trainer's host, nothing here can fail
    and leave them held (closing the trainer releases them)."""
    reg = plugins.registry

    def build(kind: Kind, sel: Any) -> Any:
        return reg.get(kind, sel.name).build(sel.options)

    rollout, eval_rollout = _rollout_functions(config, reg, build)
    algorithm = build(Kind.ALGORITHM, config.algorithm)
    if config.loss is not None:
        algorithm = WithLoss(algorithm, build(Kind.LOSS_FUNCTION, config.loss))
    parts = Parts(
        data=build(Kind.DATA_SOURCE, config.data),
        reward=build(Kind.REWARD_FUNCTION, config.reward),
        rollout=rollout,
        algorithm=algorithm,
        trainer=None,
        launcher=build_engine(
            reg,
            config.engine.name,
            config.engine.options,
            true_on_policy=config.rollout.true_on_policy,
        ),
        transport=None,
        schedule=reg.get(Kind.SCHEDULE, config.run.mode).build(None),
        router=build(Kind.ROUTER, config.router) if config.router is not None else None,
        family=build(Kind.MODEL_FAMILY, config.model.family) if config.model.family else None,
        modality=build(Kind.MODALITY, config.modality),
        eval_rollout=eval_rollout,
        teacher_launcher=(
            build(Kind.ROLLOUT_ENGINE, config.teacher.engine or config.engine)
            if config.teacher is not None
            else None
        ),
        group_filters=[build(Kind.GROUP_FILTER, s) for s in config.filters.group],
        sample_filters=[build(Kind.SAMPLE_FILTER, s) for s in config.filters.sample],
        sinks=[build(Kind.METRIC_SINK, s) for s in config.metrics.sinks],
        engine_capabilities=reg.record(RolloutEngine, config.engine.name).capabilities,
    )
    _add_adapters(config, parts, build)
    _place(config, plugins, parts, build)
    return parts


def _rollout_functions(
    config: RunConfig, reg: Registry, build: Callable[[Kind, Any], Any]
) -> tuple[Any, Any]:
    """The run's rollout function and the one the held-out evaluation generates with: the
    run's when it generates (the same object), else its own (``eval.rollout_function``, or
    the modality's default)."""
    name = rollout_function_name(config, reg)
    if config.rollout_function is None:
        if not name:
            raise MilesUserError(
                f"modality {config.modality.name!r} has no default rollout function; "
                "set rollout_function in the run config"
            )
        rollout = reg.get(Kind.ROLLOUT_FUNCTION, name).build(None)
    else:
        rollout = build(Kind.ROLLOUT_FUNCTION, config.rollout_function)
    eval_rollout = rollout
    eval_selection = eval_rollout_function(config, reg)
    if eval_selection is not None and (
        config.eval.rollout_function is not None or eval_selection.name != name
    ):
        eval_rollout = build(Kind.ROLLOUT_FUNCTION, eval_selection)
    return rollout, eval_rollout


def _add_adapters(config: RunConfig, parts: Parts, build: Callable[[Kind, Any], Any]) -> None:
    """What the engines serve of each adapter; with several, each one's prompts and reward."""
    for selection in config.adapter_selections():
        impl = build(Kind.ADAPTER, selection)
        parts.adapters.append(AdapterSync(name=impl.name, config=impl.engine_config()))
    if config.adapters:  # each adapter its own prompts and reward
        from miles_core.runtime.adapters import AdapterPrompts

        parts.data = AdapterPrompts(
            {e.name: build(Kind.DATA_SOURCE, e.data or config.data) for e in config.adapters}
        )
        parts.rewards = {
            e.name: build(Kind.REWARD_FUNCTION, e.reward) for e in config.adapters if e.reward
        }


def _place(
    config: RunConfig, plugins: Plugins, parts: Parts, build: Callable[[Kind, Any], Any]
) -> None:
    """The trainer and the transport: a placement plugin's (which may replace the launcher),
    else built here beside the engines."""
    placed = plugins.hooks.place(config, parts.launcher)
    if placed is not None:
        parts.trainer, parts.transport, parts.launcher = placed
    elif config.run.placement == "disaggregated":
        raise MilesUserError(
            "run.placement 'disaggregated' needs a placement plugin to put the trainer and the "
            "engines on separate devices, and none is installed: install miles-ray "
            "(pip install miles-ray), or set run.placement: colocated"
        )
    else:
        parts.trainer = build_trainer(
            plugins.registry,
            config.backend.name,
            config.backend.options,
            [(s.name, s.options) for s in config.adapter_selections()],
            routing=config.rollout.routing,
            true_on_policy=config.rollout.true_on_policy,
        )
        parts.transport = build(Kind.TRANSPORT, config.transport)


def run_metadata(config: RunConfig, plugins: Plugins) -> dict[str, Any]:
    """What ran: Python, the core and every plugin distribution with its version."""
    import platform

    dists = {i.distribution: i.version for i in plugins.pm.infos.values()}
    for extra in ("torch", "transformers"):
        try:
            dists.setdefault(extra, dist_version(extra))
        except PackageNotFoundError:  # not installed: nothing to record
            continue
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "distributions": dict(sorted(dists.items())),
        "config": config.to_plain(),
    }
