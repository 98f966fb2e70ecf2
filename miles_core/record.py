"""The base of every component record: its kind, name, schema, factory and compatibility.

:mod:`miles_core.components` holds one record class per kind; this module holds what they
share, so the records and the capability vocabulary (:mod:`miles_core.capabilities`) sit at the
bottom of the core, below the config, the registry and the plugin manager.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from pydantic import BaseModel

from miles_core.capabilities import Need, check_names

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
        check: value-level compatibility rule, called with the validated
            :class:`~miles_core.config.RunConfig`; returns a reason to refuse, or ``None``.
        provides: capability names the part offers besides those its typed fields declare
            (:mod:`miles_core.capabilities`); a plugin may use names of its own.
        demands: what the part needs of the other selected parts (:class:`Need`), besides
            those its typed fields declare.
    """

    kind: ClassVar[Kind]
    name: str
    factory: Callable[..., Any] | str
    config: type[BaseModel] | None = None
    description: str = ""
    requires: Mapping[str, Sequence[str]] = field(default_factory=dict)
    excludes: Mapping[str, Sequence[str]] = field(default_factory=dict)
    check: Callable[[Any], str | None] | None = None
    provides: frozenset[str] = frozenset()
    demands: tuple[Need, ...] = ()

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
        object.__setattr__(self, "provides", frozenset(self.provides))
        object.__setattr__(self, "demands", tuple(self.demands))
        check_names(f"{self.kind.label} {self.name!r}", self.provides)
        for need in self.demands:
            if not isinstance(need, Need):
                raise TypeError(
                    f"{self.kind.label} {self.name!r}: demands holds {need!r}; each must be a "
                    "miles_core.components.Need"
                )
            check_names(f"{self.kind.label} {self.name!r}", need.capabilities)

    def offers(self) -> frozenset[str]:
        """Every capability name the part offers: ``provides`` and those of its typed fields."""
        return self.provides | self._offered()

    def wants(self) -> tuple[Need, ...]:
        """Everything the part needs of the other selected parts: ``demands`` and the needs
        of its typed fields."""
        return (*self._needed(), *self.demands)

    def run_features(self) -> frozenset[str]:
        """The run config's features the part cannot run without (``teacher``...)."""
        return frozenset()

    def _offered(self) -> frozenset[str]:
        return frozenset()

    def _needed(self) -> tuple[Need, ...]:
        return ()

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
        if self.provides:
            out["provides"] = sorted(self.provides)
        if self.demands:
            out["demands"] = [
                {"role": n.role, "capabilities": sorted(n.capabilities), "when": n.when}
                for n in self.demands
            ]
        out.update(self._extra())
        return out

    def _extra(self) -> dict[str, Any]:
        return {}
