"""What a plugin registers: one typed record per component, by kind.

A plugin's registration hook receives a ``register`` callback and calls it with one of the
classes below. A record is declarative and cheap: it names the component, its config schema
(a pydantic model, validated when a run selects it), what it is compatible with, and a
*factory* that builds the working object. The factory may be given as ``"module:attr"`` so that
listing plugins or validating a config never imports torch or an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_core.capabilities import (
    ALGORITHM_NEEDS,
    ENGINE_CAPABILITIES,
    FROM_SAMPLES,
    Need,
    check_names,
)
from miles_core.record import RUN_SLOTS, Component, Kind, _resolve

__all__ = [
    "ALGORITHM_NEEDS",
    "COMPONENT_CLASSES",
    "ENGINE_CAPABILITIES",
    "FROM_SAMPLES",
    "RUN_SLOTS",
    "Adapter",
    "Algorithm",
    "Component",
    "DataSource",
    "GroupFilter",
    "Kind",
    "LossFunction",
    "MetricSink",
    "Modality",
    "ModelFamily",
    "Need",
    "RewardFunction",
    "RolloutEngine",
    "RolloutFunction",
    "Router",
    "SampleFilter",
    "Schedule",
    "TrainerBackend",
    "Transport",
]


@dataclass(frozen=True, kw_only=True)
class TrainerBackend(Component):
    """A trainer backend (FSDP2, Megatron-core, LoRA...). Builds a :class:`contracts.Trainer`."""

    kind: ClassVar[Kind] = Kind.TRAINER_BACKEND
    devices: tuple[str, ...] = ("cpu",)
    #: the inputs an algorithm may need (:data:`ALGORITHM_NEEDS`) that it computes, checked
    #: against the selected algorithm's ``needs`` at start; ``None``: not declared, so
    #: nothing is checked at start (the backend refuses what it lacks at its first step)
    computes: frozenset[str] | None = None
    #: the adapters (names of :class:`Adapter` components, ``lora``) it composes with: a run
    #: selecting another adapter is refused at start. Its factory is then called as
    #: ``factory(options, adapter=obj)`` with the adapter's object
    #: (:class:`contracts.AdapterImpl`), and the trainer it builds implements
    #: :class:`contracts.AdapterTrainer`
    adapters: frozenset[str] = frozenset()
    #: whether it trains several adapters on one base at once (the config's ``adapters``):
    #: its factory is then called as ``factory(options, adapters=[obj, ...])``, each group
    #: trains the adapter it names (``Group.adapter``), and ``export_weights(name)``,
    #: ``export_model(name)`` and ``save_adapter(path, name)`` take the adapter's name
    multi_adapter: bool = False
    #: whether it takes the engine's routing record of an MoE model (the config's
    #: ``rollout.routing``: ``record`` measures the expert agreement, ``replay`` trains on the
    #: engine's expert choices): its factory is then called with ``routing="record"`` or
    #: ``routing="replay"``; a run asking it of a backend that does not is refused at start
    routing: bool = False
    #: whether it recomputes log-probs bitwise equal to an engine's in true on-policy mode (the
    #: config's ``rollout.true_on_policy``): its factory is then called with
    #: ``true_on_policy=True``, and it fails a step where a token differs
    true_on_policy: bool = False
    #: whether a placement may start its ranks where it chooses (one Ray actor per rank, on
    #: any node): its factory is then called with ``ranks=`` a launcher of them, and every
    #: world size runs through it; its options have ``world_size`` (how many ranks)
    placed_ranks: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.computes or ()) - set(ALGORITHM_NEEDS)
        if unknown:
            raise ValueError(
                f"trainer backend {self.name!r} computes unknown inputs {sorted(unknown)}; "
                f"allowed: {', '.join(ALGORITHM_NEEDS)}"
            )
        check_names(f"trainer backend {self.name!r}", self.adapters)

    def _offered(self) -> frozenset[str]:
        # An undeclared ``computes`` is checked by the backend at its first step, not here.
        out = set(ALGORITHM_NEEDS if self.computes is None else self.computes)
        out |= {f"adapter:{name}" for name in self.adapters}
        flags = {
            "multi_adapter": self.multi_adapter,
            "routing": self.routing,
            "true_on_policy": self.true_on_policy,
            "placed_ranks": self.placed_ranks,
        }
        return frozenset(out | {name for name, on in flags.items() if on})

    def _extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"devices": list(self.devices)}
        if self.computes is not None:
            out["computes"] = sorted(self.computes)
        if self.adapters:
            out["adapters"] = sorted(self.adapters)
        if self.multi_adapter:
            out["multi_adapter"] = True
        if self.routing:
            out["routing"] = True
        if self.true_on_policy:
            out["true_on_policy"] = True
        return out


@dataclass(frozen=True, kw_only=True)
class RolloutEngine(Component):
    """A rollout engine (SGLang, the embedded engine).

    Builds a :class:`contracts.EngineLauncher`."""

    kind: ClassVar[Kind] = Kind.ROLLOUT_ENGINE
    devices: tuple[str, ...] = ("cpu",)
    #: the engine capabilities (:data:`ENGINE_CAPABILITIES`) its servers provide
    capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        check_names(f"rollout engine {self.name!r}", self.capabilities)

    def _offered(self) -> frozenset[str]:
        return self.capabilities

    def _extra(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "capabilities": sorted(self.capabilities)}


@dataclass(frozen=True, kw_only=True)
class Algorithm(Component):
    """An RL algorithm: an advantage estimator and a per-token loss. Builds a
    :class:`contracts.Algorithm`.

    Attributes:
        needs: extra inputs the loop must compute for it (subset of ``ALGORITHM_NEEDS``); the
            loop asks only for these.
        importance_ratios: the loss uses PPO-style ratios against a behaviour policy, so an
            asynchronous run must choose its off-policy correction explicitly.
        default_rollout_function: the rollout function a run selecting this algorithm gets
            when its config names none (``sft``: samples rendered from conversations); empty:
            the modality's default.
    """

    kind: ClassVar[Kind] = Kind.ALGORITHM
    needs: frozenset[str] = frozenset()
    importance_ratios: bool = False
    default_rollout_function: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.needs) - set(ALGORITHM_NEEDS)
        if unknown:
            raise ValueError(
                f"algorithm {self.name!r} needs unknown inputs {sorted(unknown)}; "
                f"allowed: {', '.join(ALGORITHM_NEEDS)}"
            )

    def _offered(self) -> frozenset[str]:
        # What it uses, so a teacher can ask for an algorithm that uses its log-probs.
        return self.needs | ({"critic_free"} if "values" not in self.needs else frozenset())

    def _needed(self) -> tuple[Need, ...]:
        computed = self.needs - FROM_SAMPLES
        if not computed:
            return ()
        return (
            Need(
                "backend",
                computed,
                says="{by} needs {missing_names}, which {who} does not compute "
                "(it computes: {has})",
                able="backends that do",
                among=frozenset(ALGORITHM_NEEDS),
            ),
        )

    def run_features(self) -> frozenset[str]:
        """A teacher, when it needs a teacher's log-probs (:data:`FROM_SAMPLES`)."""
        return frozenset({"teacher"}) if self.needs & FROM_SAMPLES else frozenset()

    def _extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "needs": sorted(self.needs),
            "importance_ratios": self.importance_ratios,
        }
        if self.default_rollout_function:
            out["default_rollout_function"] = self.default_rollout_function
        return out


@dataclass(frozen=True, kw_only=True)
class Transport(Component):
    """A weight-sync transport (colocated, broadcast, p2p).

    ``factory`` builds the trainer side, a :class:`contracts.WeightTransport`, which publishes
    to the engines through their HTTP API. ``engine_capabilities`` names what it needs the
    engine to serve (:data:`ENGINE_CAPABILITIES`); ``receiver_factory``, when the engine side
    is not an SGLang endpoint, builds the :class:`contracts.WeightReceiver` an engine that
    provides the capability embeds, called as ``receiver_factory(options, address, rank)``.
    """

    kind: ClassVar[Kind] = Kind.TRANSPORT
    engine_capabilities: frozenset[str] = frozenset()
    receiver_factory: Callable[..., Any] | str = ""
    #: the HTTP path (``POST``) at which an engine embedding ``receiver_factory`` serves it;
    #: an engine server mounts the route of every installed transport that declares one
    receiver_route: str = ""
    #: what it needs the engine to serve to publish an adapter alone (a run with an
    #: ``adapter``); ``None``: it cannot publish adapters
    adapter_capabilities: frozenset[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_names(f"transport {self.name!r}", self.engine_capabilities)
        check_names(f"transport {self.name!r}", self.adapter_capabilities or frozenset())

    def _offered(self) -> frozenset[str]:
        return frozenset() if self.adapter_capabilities is None else frozenset({"adapter_publish"})

    def _needed(self) -> tuple[Need, ...]:
        out = []
        if self.engine_capabilities:
            out.append(Need("engine", frozenset(self.engine_capabilities)))
        if self.adapter_capabilities:
            out.append(
                Need(
                    "engine",
                    frozenset(self.adapter_capabilities),
                    when="adapter",
                    says="{by} publishes an adapter through the engine capabilities {missing}, "
                    "which {who} does not serve",
                )
            )
        return tuple(out)

    def load_receiver(self) -> Callable[..., Any]:
        """Return the receiver factory, importing it if given as ``"module:attr"``."""
        if not self.receiver_factory:
            raise TypeError(f"transport {self.name!r} declares no receiver_factory")
        return _resolve(self.receiver_factory, f"transport {self.name!r} receiver")

    def _extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine_capabilities": sorted(self.engine_capabilities)}
        if self.adapter_capabilities is not None:
            out["adapter_capabilities"] = sorted(self.adapter_capabilities)
        return out


@dataclass(frozen=True, kw_only=True)
class ModelFamily(Component):
    """A model family: chat template + tool-call and reasoning parsers, verified by the gates.
    Builds a :class:`contracts.Family`."""

    kind: ClassVar[Kind] = Kind.MODEL_FAMILY


@dataclass(frozen=True, kw_only=True)
class Modality(Component):
    """A modality (text, diffusion): what a rollout produces and which rollout function
    generates it by default."""

    kind: ClassVar[Kind] = Kind.MODALITY
    default_rollout_function: str = ""

    def _extra(self) -> dict[str, Any]:
        return {"default_rollout_function": self.default_rollout_function}


@dataclass(frozen=True, kw_only=True)
class RolloutFunction(Component):
    """Makes one group for one prompt record. Builds a :class:`contracts.RolloutFn`.

    Attributes:
        generates: it generates with the engine. One that makes its samples from the record
            alone (``sft`` renders a conversation from data) declares False: the held-out
            evaluation then generates with the modality's default rollout function, and the
            held-out loss (``eval.loss_data``) is available.
    """

    kind: ClassVar[Kind] = Kind.ROLLOUT_FUNCTION
    generates: bool = True

    def _extra(self) -> dict[str, Any]:
        return {"generates": self.generates}


@dataclass(frozen=True, kw_only=True)
class RewardFunction(Component):
    """Scores a sample. Builds a :class:`contracts.RewardFn`."""

    kind: ClassVar[Kind] = Kind.REWARD_FUNCTION


@dataclass(frozen=True, kw_only=True)
class SampleFilter(Component):
    """Keeps or drops one sample. Builds a :class:`contracts.SampleFilterFn`."""

    kind: ClassVar[Kind] = Kind.SAMPLE_FILTER


@dataclass(frozen=True, kw_only=True)
class GroupFilter(Component):
    """Keeps or drops a whole group. Builds a :class:`contracts.GroupFilterFn`."""

    kind: ClassVar[Kind] = Kind.GROUP_FILTER


@dataclass(frozen=True, kw_only=True)
class LossFunction(Component):
    """A per-token loss that replaces an algorithm's own. Builds a :class:`contracts.LossFn`."""

    kind: ClassVar[Kind] = Kind.LOSS_FUNCTION


@dataclass(frozen=True, kw_only=True)
class DataSource(Component):
    """A source of prompts. Builds a :class:`contracts.PromptSource`."""

    kind: ClassVar[Kind] = Kind.DATA_SOURCE


@dataclass(frozen=True, kw_only=True)
class MetricSink(Component):
    """Receives every step's metrics. Builds a :class:`contracts.MetricWriter`.

    Attributes:
        essential: the sink is the run's own record (the plot and the evaluation summary are
            drawn from it), so its failure stops the run; any other sink that fails is
            reported once, disabled and counted in ``sinks/failures``.
    """

    kind: ClassVar[Kind] = Kind.METRIC_SINK
    essential: bool = False


@dataclass(frozen=True, kw_only=True)
class Router(Component):
    """A request router in front of several engines. Builds a :class:`contracts.Router`."""

    kind: ClassVar[Kind] = Kind.ROUTER


@dataclass(frozen=True, kw_only=True)
class Schedule(Component):
    """How rollout and training interleave (synchronous, fully asynchronous), selected by
    ``run.mode``. Builds the schedule the run takes its batches from."""

    kind: ClassVar[Kind] = Kind.SCHEDULE
    #: every token it trains was generated by the trainer's current weights (the synchronous
    #: schedule); ``rollout.true_on_policy`` needs such a schedule
    on_policy: bool = False

    def _offered(self) -> frozenset[str]:
        return frozenset({"on_policy"}) if self.on_policy else frozenset()

    def _extra(self) -> dict[str, Any]:
        return {"on_policy": self.on_policy}


@dataclass(frozen=True, kw_only=True)
class Adapter(Component):
    """A parameter-efficient adapter (LoRA) the trainer backend wraps the policy in: only the
    adapter is trained and synced to the engines, which serve it beside the frozen base.
    Builds a :class:`contracts.AdapterImpl`, which the backend's factory receives as
    ``factory(options, adapter=obj)``; a backend composes with the adapters its record lists
    (:attr:`TrainerBackend.adapters`).

    Attributes:
        engine_capabilities: what the run's engine must serve (:data:`ENGINE_CAPABILITIES`)
            to load the synced adapter (``lora``: SGLang's LoRA API).
    """

    kind: ClassVar[Kind] = Kind.ADAPTER
    engine_capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_names(f"adapter {self.name!r}", self.engine_capabilities)

    def _needed(self) -> tuple[Need, ...]:
        composes = Need(
            "backend",
            frozenset({f"adapter:{self.name}"}),
            says="{by} (adapter.name) does not compose with {who}",
            able=f"backends that take {self.name!r}",
        )
        if not self.engine_capabilities:
            return (composes,)
        serves = Need(
            "engine",
            frozenset(self.engine_capabilities),
            says="{by} needs the engine capabilities {missing} to serve the trained adapter, "
            "which {who} does not serve",
        )
        return (composes, serves)

    def _extra(self) -> dict[str, Any]:
        return {"engine_capabilities": sorted(self.engine_capabilities)}


#: Record class of each kind.
COMPONENT_CLASSES: dict[Kind, type[Component]] = {
    cls.kind: cls
    for cls in (
        TrainerBackend,
        RolloutEngine,
        Algorithm,
        Transport,
        ModelFamily,
        Modality,
        RolloutFunction,
        RewardFunction,
        SampleFilter,
        GroupFilter,
        LossFunction,
        DataSource,
        MetricSink,
        Router,
        Schedule,
        Adapter,
    )
}
