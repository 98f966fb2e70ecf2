"""What a plugin registers: one typed record per component, by kind.

A plugin's registration hook receives a ``register`` callback and calls it with one of the
classes below. A record is declarative and cheap: it names the component, its config schema
(a pydantic model, validated when a run selects it), what it is compatible with, and a
*factory* that builds the working object. The factory may be given as ``"module:attr"`` so that
listing plugins or validating a config never imports torch or an engine.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from miles_core.config import RunConfig

_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")


class Kind(str, Enum):
    """The kinds of component a plugin can register; each has its own registration hook."""

    TRAINER_BACKEND = "trainer_backend"
    ROLLOUT_ENGINE = "rollout_engine"
    ALGORITHM = "algorithm"
    TRANSPORT = "transport"
    MODEL_FAMILY = "model_family"
    MODALITY = "modality"
    ROLLOUT_FUNCTION = "rollout_function"
    REWARD_FUNCTION = "reward_function"
    SAMPLE_FILTER = "sample_filter"
    GROUP_FILTER = "group_filter"
    LOSS_FUNCTION = "loss_function"
    DATA_SOURCE = "data_source"
    METRIC_SINK = "metric_sink"
    ROUTER = "router"
    SCHEDULE = "schedule"
    ADAPTER = "adapter"

    @property
    def label(self) -> str:
        """Human name: ``"trainer backend"``."""
        return self.value.replace("_", " ")

    @property
    def hook(self) -> str:
        """Name of the registration hook for this kind: ``miles_register_trainer_backends``."""
        plural = {"model_family": "model_families", "modality": "modalities"}
        return f"miles_register_{plural.get(self.value, self.value + 's')}"


#: What an engine can do beyond generation and SGLang's control calls, each named for the
#: HTTP endpoint(s) that provide it. An engine record lists those it serves (``capabilities``);
#: a transport record lists those it needs (``engine_capabilities``); a run pairing a transport
#: with an engine that lacks one is refused when the config is validated.
ENGINE_CAPABILITIES: dict[str, str] = {
    "update_weights_from_tensor": "SGLang's POST /update_weights_from_tensor (colocated handles)",
    "update_weights_from_distributed": (
        "SGLang's POST /init_weights_update_group and /update_weights_from_distributed"
    ),
    "p2p_weights": "a NIXL receiver the trainer writes into (not an SGLang endpoint)",
    "memory_occupation": "SGLang's POST /release_memory_occupation and /resume_memory_occupation",
    "input_logprobs": (
        "SGLang's prompt log-probs on POST /generate (return_logprob with logprob_start_len, "
        "max_new_tokens 0): a teacher's engine scores tokens it did not generate"
    ),
    "lora": (
        "SGLang's LoRA API: POST /load_lora_adapter, /unload_lora_adapter, "
        "/load_lora_adapter_from_tensors and lora_path on /generate"
    ),
    "routed_experts": (
        "SGLang's return_routed_experts on POST /generate: the experts an MoE model routed every "
        "forwarded position to (meta_info['routed_experts'])"
    ),
    "true_on_policy": (
        "started with true_on_policy=True by a run's rollout.true_on_policy, its log-probs are "
        "bitwise those a trainer backend in the same mode recomputes (miles_core.invariant)"
    ),
    "lora_weight_updates": (
        "POST /miles/update_lora_from_distributed, and lora_name on /miles/p2p_weights: a "
        "broadcast or p2p update committed into that adapter (not an SGLang feature)"
    ),
}


def _check_capabilities(who: str, names: frozenset[str]) -> None:
    unknown = sorted(set(names) - set(ENGINE_CAPABILITIES))
    if unknown:
        raise ValueError(
            f"{who} names unknown engine capabilities {unknown}; "
            f"allowed: {', '.join(ENGINE_CAPABILITIES)}"
        )


#: Selection slots a compatibility declaration may refer to, besides the component kinds.
RUN_SLOTS: dict[str, tuple[str, ...]] = {
    "mode": ("sync", "async"),
    "placement": ("colocated", "disaggregated"),
}


def _resolve(factory: Callable[..., Any] | str, who: str) -> Callable[..., Any]:
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{who}: factory {factory} is not callable")
    return obj  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class Component:
    """Base record of a registered component.

    Attributes:
        name: unique name within its kind (lowercase, ``[a-z0-9_.-]``); what configs select.
        factory: builds the working object, called as ``factory(options)`` with the validated
            options model (or ``None`` when ``config`` is ``None``). A ``"module:attr"`` string
            is imported only when the component is built.
        config: pydantic model of the component's options in a run config.
        description: one line shown by ``miles plugins``.
        requires: slot -> allowed names; the run must select one of them in that slot
            (slots are the kind names, ``mode`` and ``placement``).
        excludes: slot -> names this component cannot run with.
        check: value-level compatibility rule; returns a reason to refuse, or ``None``.
    """

    kind: ClassVar[Kind]
    name: str
    factory: Callable[..., Any] | str
    config: type[BaseModel] | None = None
    description: str = ""
    requires: Mapping[str, Sequence[str]] = field(default_factory=dict)
    excludes: Mapping[str, Sequence[str]] = field(default_factory=dict)
    check: Callable[[RunConfig], str | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"{self.kind.label} name {self.name!r} is invalid: use lowercase letters, digits, "
                "'_', '-', '.', starting with a letter"
            )
        if self.config is not None and not (
            isinstance(self.config, type) and issubclass(self.config, BaseModel)
        ):
            raise TypeError(f"{self.kind.label} {self.name!r}: config must be a pydantic model")
        for slot in (*self.requires, *self.excludes):
            if slot not in RUN_SLOTS and slot not in {k.value for k in Kind}:
                allowed = ", ".join([*RUN_SLOTS, *(k.value for k in Kind)])
                raise ValueError(
                    f"{self.kind.label} {self.name!r} declares unknown slot {slot!r}; "
                    f"allowed: {allowed}"
                )

    def load(self) -> Callable[..., Any]:
        """Return the factory, importing it if it was given as ``"module:attr"``."""
        return _resolve(self.factory, f"{self.kind.label} {self.name!r}")

    def build(self, options: BaseModel | None = None) -> Any:
        """Build the working object from validated options (defaults when omitted)."""
        if options is None and self.config is not None:
            options = self.config()
        return self.load()(options)

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary used by ``miles plugins``."""
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.requires:
            out["requires"] = {k: list(v) for k, v in self.requires.items()}
        if self.excludes:
            out["excludes"] = {k: list(v) for k, v in self.excludes.items()}
        out.update(self._extra())
        return out

    def _extra(self) -> dict[str, Any]:
        return {}


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

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.computes or ()) - set(ALGORITHM_NEEDS)
        if unknown:
            raise ValueError(
                f"trainer backend {self.name!r} computes unknown inputs {sorted(unknown)}; "
                f"allowed: {', '.join(ALGORITHM_NEEDS)}"
            )

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
        _check_capabilities(f"rollout engine {self.name!r}", self.capabilities)

    def _extra(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "capabilities": sorted(self.capabilities)}


#: Inputs an algorithm may ask the loop for, beyond rollout log-probs and rewards.
ALGORITHM_NEEDS = ("ref_logprobs", "teacher_logprobs", "values", "old_logprobs")

#: The inputs of :data:`ALGORITHM_NEEDS` that come with the samples rather than from the trainer
#: backend: a teacher's log-probs are scored by the teacher's engine (the run config's
#: ``teacher``) while the groups are generated, and every backend packs them like the engine's.
FROM_SAMPLES = frozenset({"teacher_logprobs"})


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
    #: what it needs the engine to serve to publish an adapter alone (a run with an
    #: ``adapter``); ``None``: it cannot publish adapters
    adapter_capabilities: frozenset[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_capabilities(f"transport {self.name!r}", self.engine_capabilities)
        _check_capabilities(f"transport {self.name!r}", self.adapter_capabilities or frozenset())

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
        _check_capabilities(f"adapter {self.name!r}", self.engine_capabilities)

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
