"""The run config's features, as data: what each needs of the selected parts.

A feature (``rollout.routing``, ``rollout.true_on_policy``, an adapter, several adapters, a
teacher) is on when its value is truthy. While it is on, each of its :class:`Need` must be met
by the part its role selects, the features it excludes must be off, and its value-level rule
(``check``: what a model's ``config.json`` says) must pass. A part that cannot run without a
feature names it (:meth:`~miles_core.components.Component.run_features`); the feature's
``missing`` line says what to add. :mod:`miles_core.config.compatibility` does the checking.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.capabilities import FEATURES as FEATURE_NAMES
from miles_core.capabilities import Need
from miles_core.components import Modality, RolloutFunction
from miles_core.config.schema import RunConfig, Selection
from miles_core.registry import Registry


@dataclass(frozen=True)
class Feature:
    """A feature of the run config and what it needs of the selected parts.

    Attributes:
        name: its key in :data:`miles_core.capabilities.FEATURES`.
        label: the field its problems are reported at, a template over ``value``.
        value: its value in a validated config; falsy: the feature is off.
        needs: what the selected parts must offer while it is on.
        excludes: other features that cannot be on with it, each with the reason.
        missing: the line when a selected part needs it and it is off (template over ``by``).
        check: value-level rule with the registry at hand; returns its problem lines.
    """

    name: str
    label: str
    value: Callable[[RunConfig], Any]
    needs: tuple[Need, ...] = ()
    excludes: Mapping[str, str] = field(default_factory=dict)
    missing: str = ""
    check: Callable[[RunConfig, Registry], list[str]] | None = None


def _adapters_problems(config: RunConfig, registry: Registry) -> list[str]:
    """Adapters trained together write to folders of their own, and the evaluation's held-out
    loss is taken on one policy."""
    problems = []
    seen: dict[Path, str] = {}
    for name, folder in config.adapter_dirs().items():
        for other_dir, other in seen.items():
            if folder == other_dir or other_dir in folder.parents or folder in other_dir.parents:
                problems.append(
                    f"adapters: {name!r} and {other!r} name the same output folder "
                    f"({folder if folder == other_dir else 'one inside the other'}); each "
                    "adapter's output_dir must be its own"
                )
        seen[folder] = name
    if len(config.adapters) > 1 and config.eval.loss_data is not None:
        problems.append(
            "eval.loss_data: the held-out loss is taken on one policy, and this run trains "
            f"{len(config.adapters)} adapters; evaluate them by accuracy (adapters[].eval_data)"
        )
    return problems


def _model_config(config: RunConfig) -> tuple[dict[str, Any] | None, str]:
    """The policy's ``config.json``, or ``None`` and why it cannot be read."""
    path = Path(config.model.path).expanduser() / "config.json"
    try:
        return json.loads(path.read_text()), ""
    except (OSError, ValueError) as exc:
        return None, f"{path} is not readable JSON ({exc})"


def _routing_model(config: RunConfig, registry: Registry) -> list[str]:
    """Routing needs a mixture-of-experts model."""
    mode = config.rollout.routing
    model, why = _model_config(config)
    if model is None:
        return [
            f"rollout.routing {mode!r}: cannot tell whether model.path is a mixture-of-experts "
            f"model: {why}"
        ]
    if not moe_layers(model):
        return [
            f"rollout.routing {mode!r}: model.path {config.model.path!r} has no "
            "mixture-of-experts layer (its config.json names no experts and top-k), so "
            "there is no routing to record or replay; set rollout.routing: none"
        ]
    return []


def _invariant_model(config: RunConfig, registry: Registry) -> list[str]:
    """True on-policy needs a model the batch-invariant kernels cover."""
    from miles_core.invariant import unsupported

    model, why = _model_config(config)
    reason = why if model is None else unsupported(model)
    if reason:
        return [f"rollout.true_on_policy: model.path {config.model.path!r}: {reason}"]
    return []


#: config.json keys that give an MoE model's experts per layer, by architecture family
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moe_layers(model_config: Mapping[str, Any]) -> list[int]:
    """The mixture-of-experts layers of a Hugging Face ``config.json`` (its text config when
    nested): every layer when it names experts and a top-k, but Qwen3-MoE's ``mlp_only_layers``
    and the layers ``decoder_sparse_step`` skips; empty for a dense model."""
    cfg = model_config.get("text_config") or model_config
    experts = max((int(cfg.get(k) or 0) for k in _EXPERT_KEYS), default=0)
    if experts < 2 or not int(cfg.get("num_experts_per_tok") or 0):
        return []
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    layers = int(cfg.get("num_hidden_layers") or 0)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def rollout_function_name(config: RunConfig, registry: Registry) -> str:
    """The run's rollout function: the config's (an algorithm's default is resolved into the
    config when it is validated), else the modality's default; empty when there is none."""
    if config.rollout_function is not None:
        return config.rollout_function.name
    return registry.record(Modality, config.modality.name).default_rollout_function


def _generates(registry: Registry, name: str) -> bool:
    return registry.record(RolloutFunction, name).generates


def eval_rollout_function(config: RunConfig, registry: Registry) -> Selection | None:
    """The rollout function the held-out evaluation generates with: ``eval.rollout_function``,
    else the run's when it generates, else the modality's default; ``None`` when none fits."""
    if config.eval.rollout_function is not None:
        return config.eval.rollout_function
    name = rollout_function_name(config, registry)
    if name and _generates(registry, name):
        return config.rollout_function or Selection(name=name)
    default = registry.record(Modality, config.modality.name).default_rollout_function
    if default and _generates(registry, default):
        return Selection(name=default)
    return None


def _eval_problems(config: RunConfig, registry: Registry) -> list[str]:
    """What the held-out evaluation needs of the run's rollout functions (always on)."""
    problems = []
    chosen = config.eval.rollout_function
    if chosen is not None and not _generates(registry, chosen.name):
        problems.append(
            f"eval.rollout_function {chosen.name!r} does not generate, and the held-out "
            "evaluation decodes greedily: choose one that generates (such as single_turn)"
        )
    elif config.eval.data is not None and eval_rollout_function(config, registry) is None:
        problems.append(
            f"eval.data: the run's rollout function {rollout_function_name(config, registry)!r} "
            f"does not generate and modality {config.modality.name!r} has no default one that "
            "does; name the evaluation's in eval.rollout_function"
        )
    name = rollout_function_name(config, registry)
    if config.eval.loss_data is not None and (not name or _generates(registry, name)):
        problems.append(
            "eval.loss_data: the held-out loss is taken on samples the run's rollout function "
            f"makes from the records alone, and {name!r} generates them with "
            "the engine; it needs a rollout function that does not generate (such as sft)"
        )
    return problems


def _several_adapters(config: RunConfig) -> int:
    return len(config.adapters) if len(config.adapters) > 1 else 0


def _routing(config: RunConfig) -> str:
    return "" if config.rollout.routing == "none" else config.rollout.routing


#: Every feature of the run config, checked in this order.
FEATURES: tuple[Feature, ...] = (
    Feature(
        name="adapter",
        label="",
        value=lambda config: bool(config.adapter_selections()),
        needs=(
            Need(
                "transport",
                frozenset({"adapter_publish"}),
                says="{who} cannot publish an adapter alone",
                able="transports that can",
            ),
        ),
    ),
    Feature(
        name="adapters",
        label="adapters",
        value=_several_adapters,
        needs=(
            Need(
                "backend",
                frozenset({"multi_adapter"}),
                says="{who} trains one adapter at a time, and the run lists {value}",
                able="backends that train several",
            ),
            Need(
                "algorithm",
                frozenset({"critic_free"}),
                says="{who} (algorithm.name) trains a critic, and one critic cannot serve "
                "{value} policies; train several adapters with an algorithm without values",
                able="algorithms without values",
            ),
        ),
        check=_adapters_problems,
    ),
    Feature(
        name="routing",
        label="rollout.routing {value!r}",
        value=_routing,
        needs=(
            Need(
                "backend",
                frozenset({"routing"}),
                says="{who} does not take the engine's MoE routing record",
            ),
            Need(
                "engine",
                frozenset({"routed_experts"}),
                says="{who} does not return the routed experts",
            ),
        ),
        check=_routing_model,
    ),
    Feature(
        name="true_on_policy",
        label="rollout.true_on_policy",
        value=lambda config: config.rollout.true_on_policy,
        needs=(
            Need(
                "backend",
                frozenset({"true_on_policy"}),
                says="{who} has no batch-invariant forward",
            ),
            Need(
                "engine",
                frozenset({"true_on_policy"}),
                says="{who} has no batch-invariant kernels matching a trainer's",
            ),
            Need(
                "schedule",
                frozenset({"on_policy"}),
                says="{who} trains tokens generated under older weights, which differ from the "
                "trainer's by design",
                able="on-policy schedules (run.mode)",
            ),
        ),
        excludes={
            "adapter": "adapters (LoRA) are not covered by the batch-invariant kernels",
            "routing": "the trainer's routers compute the engine's expert choices bitwise, so "
            "there is no routing record to replay; set rollout.routing: none",
        },
        check=_invariant_model,
    ),
    Feature(
        name="teacher",
        label="teacher",
        value=lambda config: config.teacher is not None,
        needs=(
            Need(
                "algorithm",
                frozenset({"teacher_logprobs"}),
                says="{who} does not use a teacher's log-probs, so the teacher would only cost "
                "time",
                able="algorithms that do",
            ),
            Need(
                "teacher.engine",
                frozenset({"input_logprobs"}),
                at="teacher.engine",
                says="{who} does not serve input_logprobs (scoring tokens it did not generate), "
                "which the teacher needs",
            ),
        ),
        missing="{by} needs teacher_logprobs: add a teacher section (teacher: {{path: <the "
        "teacher model>}}, served by its own engine; engine: defaults to the run's)",
    ),
    Feature(name="eval", label="", value=lambda config: True, check=_eval_problems),
)

#: The features by name.
BY_NAME: dict[str, Feature] = {f.name: f for f in FEATURES}
assert set(BY_NAME) - {"eval"} == set(FEATURE_NAMES), "every feature a need may name is defined"
