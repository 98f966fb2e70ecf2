"""Miles's hook specifications: this module is the hook reference.

Three families of hooks:

* **Registration hooks** ``miles_register_<kind>(register)``: a plugin calls ``register`` with
  one record from :mod:`miles_core.components` per component it provides. Names are unique per
  kind across all plugins; a duplicate is an error naming both distributions.
* **Lifecycle hooks**: called by the loop at the places a user would otherwise fork it. Their
  return values are ignored; an exception in one stops the run (after its checkpoint, metrics
  and ledger are saved).
* **The placement hook** ``miles_place``: the one "who handles this?" hook (``firstresult``);
  a placement plugin runs the trainer and the engines where the run's placement says.

Implement them in a module and register it under the entry-point group ``miles``::

    from miles_core import hookimpl

    @hookimpl
    def miles_register_reward_functions(register):
        register(RewardFunction(name="my_reward", factory=make_reward))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from miles_core.components import (
        Adapter,
        Algorithm,
        DataSource,
        GroupFilter,
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
    from miles_core.config import RunConfig
    from miles_core.contracts import EngineLauncher, Trainer, WeightTransport
    from miles_core.data import Group

hookspec = pluggy.HookspecMarker("miles")

# --- registration hooks ---------------------------------------------------------------------


@hookspec
def miles_register_trainer_backends(register: Callable[[TrainerBackend], None]) -> None:
    """Register trainer backends (FSDP2, Megatron-core...); LoRA is an adapter they compose
    with (:func:`miles_register_adapters`).

    :param register: call with one :class:`~miles_core.components.TrainerBackend` per backend.
    """


@hookspec
def miles_register_rollout_engines(register: Callable[[RolloutEngine], None]) -> None:
    """Register rollout engines (SGLang, the embedded CPU engine...).

    :param register: call with one :class:`~miles_core.components.RolloutEngine` per engine.
    """


@hookspec
def miles_register_algorithms(register: Callable[[Algorithm], None]) -> None:
    """Register RL algorithms (advantage estimator + per-token loss).

    :param register: call with one :class:`~miles_core.components.Algorithm` per algorithm.
    """


@hookspec
def miles_register_transports(register: Callable[[Transport], None]) -> None:
    """Register weight-sync transports.

    :param register: call with one :class:`~miles_core.components.Transport` per transport.
    """


@hookspec
def miles_register_model_families(register: Callable[[ModelFamily], None]) -> None:
    """Register model families (chat template + tool-call and reasoning parsers).

    :param register: call with one :class:`~miles_core.components.ModelFamily` per family.
    """


@hookspec
def miles_register_modalities(register: Callable[[Modality], None]) -> None:
    """Register modalities (text, diffusion).

    :param register: call with one :class:`~miles_core.components.Modality` per modality.
    """


@hookspec
def miles_register_rollout_functions(register: Callable[[RolloutFunction], None]) -> None:
    """Register rollout functions (generate and score one group for one prompt).

    :param register: call with one :class:`~miles_core.components.RolloutFunction` each.
    """


@hookspec
def miles_register_reward_functions(register: Callable[[RewardFunction], None]) -> None:
    """Register reward functions.

    :param register: call with one :class:`~miles_core.components.RewardFunction` each.
    """


@hookspec
def miles_register_sample_filters(register: Callable[[SampleFilter], None]) -> None:
    """Register sample filters (keep or drop one sample).

    :param register: call with one :class:`~miles_core.components.SampleFilter` each.
    """


@hookspec
def miles_register_group_filters(register: Callable[[GroupFilter], None]) -> None:
    """Register group filters (keep or drop a whole group).

    :param register: call with one :class:`~miles_core.components.GroupFilter` each.
    """


@hookspec
def miles_register_loss_functions(register: Callable[[LossFunction], None]) -> None:
    """Register loss functions that replace an algorithm's own per-token loss.

    :param register: call with one :class:`~miles_core.components.LossFunction` each.
    """


@hookspec
def miles_register_data_sources(register: Callable[[DataSource], None]) -> None:
    """Register data sources (streams of prompt records).

    :param register: call with one :class:`~miles_core.components.DataSource` each.
    """


@hookspec
def miles_register_metric_sinks(register: Callable[[MetricSink], None]) -> None:
    """Register metric sinks (JSONL, TensorBoard...).

    :param register: call with one :class:`~miles_core.components.MetricSink` each.
    """


@hookspec
def miles_register_routers(register: Callable[[Router], None]) -> None:
    """Register request routers (``sglang-router``) that spread generation over engines.

    :param register: call with one :class:`~miles_core.components.Router` each.
    """


@hookspec
def miles_register_schedules(register: Callable[[Schedule], None]) -> None:
    """Register schedules: how rollout and training interleave (``run.mode`` selects one).

    :param register: call with one :class:`~miles_core.components.Schedule` each.
    """


@hookspec
def miles_register_adapters(register: Callable[[Adapter], None]) -> None:
    """Register parameter-efficient adapters (LoRA) that a trainer backend wraps the policy in
    (the run config's ``adapter``): only the adapter trains and is synced to the engines. A
    run may train several on one base (the config's ``adapters``), each on its own groups.

    :param register: call with one :class:`~miles_core.components.Adapter` each.
    """


# --- placement ------------------------------------------------------------------------------


@hookspec(firstresult=True)
def miles_place(
    config: RunConfig, launcher: EngineLauncher
) -> tuple[Trainer, WeightTransport, EngineLauncher] | None:
    """Decide where the trainer, its weight sender and the engines run.

    Called once per run, before any device work, after the run's other components are built.
    The first plugin that returns a result owns the run's placement (``firstresult``): it builds
    the selected trainer backend and transport wherever it places them (for example in a Ray
    actor, with the same registry factories), and returns objects that satisfy
    :class:`~miles_core.contracts.Trainer` and :class:`~miles_core.contracts.WeightTransport`
    in this process, plus the launcher to start the engines with, told where each engine goes
    (for example a placement-group bundle per engine). ``config.run.placement`` says whether
    trainer and engines share devices (``colocated``) or use separate pools
    (``disaggregated``). Closing the returned trainer releases what the placement reserved; the
    loop closes the transport, then the launcher, then the trainer.

    Return ``None`` to leave the run to the default: trainer and sender built in this process,
    engines started by ``launcher`` as it is. A ``disaggregated`` run that no plugin places is
    refused.

    :param config: the validated run config.
    :param launcher: the selected engine's launcher, built and not yet used.
    :returns: ``(trainer, transport, launcher)``, or ``None``.
    """


@hookspec
def miles_placement_record(config: RunConfig) -> list[dict[str, Any]] | None:
    """Where the processes a placement plugin started for this run are (called once, after
    the engines started; the run's ``run.json`` keeps every answer under ``placement``).

    :param config: the validated run config (the same object :func:`miles_place` got).
    :returns: one record per process (``role`` such as ``trainer_rank`` or ``engine``, its
        index, ``address`` — the node's — and ``pid``...), or ``None`` when this plugin did not
        place the run.
    """


@hookspec
def miles_engines_to_add(config: RunConfig, engines: int) -> int | None:
    """How many engines a placement plugin that watches its cluster would add to the running
    job now: the Ray placement with ``join_new_nodes``, as many as the nodes that joined the
    cluster since it last answered hold (one engine's resources each). Called at each step's
    start; the answers are summed, and that many engines join (see ``miles fleet join``).

    :param config: the validated run config (the same object :func:`miles_place` got).
    :param engines: the job's engines now, those still starting included.
    :returns: how many engines to add, or ``None`` when this plugin has nothing to say.
    """


# --- lifecycle hooks ------------------------------------------------------------------------


@hookspec(historic=True)
def miles_configure(config: RunConfig) -> None:
    """Called once with the validated run config before any device work starts.

    Historic: a plugin registered later still receives the call.

    :param config: the validated run config.
    """


@hookspec
def miles_run_start(config: RunConfig, run_dir: str) -> None:
    """Called when a run starts, after components are built and before the first rollout.

    :param config: the validated run config.
    :param run_dir: the folder of this run's checkpoints, metrics and ledger.
    """


@hookspec
def miles_run_end(config: RunConfig, run_dir: str, status: str) -> None:
    """Called when a run ends, whatever the reason, after its state is saved.

    :param config: the validated run config.
    :param run_dir: the folder of this run's checkpoints, metrics and ledger.
    :param status: ``"completed"``, ``"failed"`` or ``"interrupted"``.
    """


@hookspec
def miles_group_finished(group: Group, step: int) -> None:
    """Called after a group is generated and scored, before the group filters judge it.

    :param group: the finished group.
    :param step: the trainer step the rollout belongs to.
    """


@hookspec
def miles_before_train_step(step: int, groups: list[Group]) -> None:
    """Called before a train step with the groups it will consume.

    :param step: the step about to run (1-based).
    :param groups: the groups of the step's batch.
    """


@hookspec
def miles_after_train_step(step: int, groups: list[Group], metrics: Mapping[str, float]) -> None:
    """Called after a train step.

    :param step: the step that ran.
    :param groups: the groups it consumed.
    :param metrics: the step's training metrics.
    """


@hookspec
def miles_after_weight_sync(step: int, version: int, metrics: Mapping[str, float]) -> None:
    """Called after the engines serve the new weights.

    :param step: the step whose weights were synced.
    :param version: the weight version the engines now serve.
    :param metrics: the sync's timing and size metrics.
    """


@hookspec
def miles_metrics_emitted(step: int, metrics: Mapping[str, float]) -> None:
    """Called with every step's complete metrics, after the metric sinks wrote them.

    :param step: the step the metrics belong to.
    :param metrics: name -> value.
    """
