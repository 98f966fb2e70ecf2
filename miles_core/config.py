"""The run config: one YAML file, validated against the schema the selected plugins contribute.

Validation has two phases. The core's own sections (``run``, ``model``, ``rollout``, ``buffer``,
``plugins``) have fixed schemas. Each *selection* (``backend``, ``algorithm``, ``transport``...)
names a registered component and carries that component's options, which are validated by the
component's own pydantic model. Every problem is reported at once, one line each, with the
field's path and what is allowed. Then the selected components' compatibility declarations are
checked, so an impossible combination is refused before any work starts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
)

from miles_core.components import (
    FROM_SAMPLES,
    Adapter,
    Algorithm,
    Component,
    Kind,
    Modality,
    RolloutEngine,
    RolloutFunction,
    TrainerBackend,
    Transport,
)
from miles_core.errors import ConfigError, IncompatibleError, MilesUserError
from miles_core.registry import Registry


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Strict):
    """How the run is laid out: its name and folder, seed, length, mode and placement."""

    name: str = Field(
        "run",
        description="the run's folder under output_dir: one folder name (not empty, not "
        "'.' or '..', no '/' or '\\')",
    )
    output_dir: str = "runs"
    seed: int = Field(0, description="seeds the rollouts' sampling (per step and prompt)")
    steps: int = Field(10, ge=1, description="train steps")
    mode: str = Field(
        "sync",
        description="the schedule (a registered component): 'sync' generates then trains; "
        "'async' generates continuously into a bounded buffer",
    )
    placement: Literal["colocated", "disaggregated"] = "colocated"
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = at the end")
    offload: bool = Field(
        False,
        description="colocated turn-taking: the engines release their memory (KV cache, and "
        "weights on an accelerator) while the trainer trains, and the trainer sleeps (frees "
        "gradients; moves weights and optimizer state off an accelerator) while the engines "
        "generate. For trainer and engines sharing an accelerator; on a CPU it only costs time",
    )
    export: bool = Field(
        False,
        description="at the end, write the trained policy as a Hugging Face checkpoint "
        "(safetensors, the model's config and tokenizer) under <output_dir>/<name>/model, "
        "loadable by transformers and servable by an engine (a distillation teacher)",
    )

    @field_validator("name")
    @classmethod
    def _one_folder(cls, value: str) -> str:
        # The run owns <output_dir>/<name> and nothing else: a path here would write (and a
        # new run move aside) folders outside output_dir, or output_dir itself.
        if not value.strip() or value in (".", "..") or any(c in value for c in "/\\\0"):
            raise ValueError(
                f"run.name {value!r} is not allowed: it must be one folder name under "
                "run.output_dir (not empty, not '.' or '..', no '/', '\\' or NUL)"
            )
        return value


class RolloutSection(_Strict):
    """How groups are generated."""

    group_size: int = Field(4, ge=1, description="samples per prompt")
    groups_per_step: int = Field(8, ge=1, description="groups the trainer consumes per step")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = no top-k")
    routing: Literal["none", "record", "replay"] = Field(
        "none",
        description="the engine's MoE routing record (SGLang's return_routed_experts): 'none'; "
        "'record': samples carry it and the trainer measures its expert agreement with it; "
        "'replay': the trainer routes every token to the experts the engine chose (rollout "
        "routing replay, R3), the gate weights recomputed from its own router. Refused for a "
        "model without a mixture-of-experts layer",
    )
    true_on_policy: bool = Field(
        False,
        description="the engines and the trainer run batch-invariant kernels, so the trainer's "
        "log-prob of every sampled token is bitwise the engine's (the PPO ratio at the first "
        "micro-step is exactly 1); a step where one differs fails, naming the sample and "
        "position. Needs an engine and a trainer backend that support it, a model they cover "
        "(miles_core.invariant.MODEL_TYPES), the synchronous loop, and no adapter",
    )


class BufferSection(_Strict):
    """The bounded buffer of the fully asynchronous mode."""

    capacity: int = Field(16, ge=1, description="groups")
    max_staleness: int = Field(1, ge=0, description="weight versions")
    on_drop: Literal["retry", "discard"] = "discard"
    pause_mode: Literal["retract", "freeze"] = Field(
        "retract",
        description="how generation pauses for a weight update: 'retract' aborts in-flight "
        "requests and continues them from their partial output under the new weights (every "
        "token's version exact); 'freeze' pauses them in place (tokens stamped with the "
        "version their request started with: staleness never underestimated)",
    )


class PluginsSection(_Strict):
    """Which installed plugins load (added to MILES_PLUGINS / MILES_BLOCK_PLUGINS), and the
    options of plugins that are not a selected component (a placement plugin, say)."""

    allow: list[str] = Field(default_factory=list)
    block: list[str] = Field(default_factory=list)
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="options keyed by plugin (entry-point) name, e.g. {ray: {trainer_cpus: 2}}; "
        "each plugin validates its own, with errors naming plugins.options.<plugin>.<field>",
    )


class Selection(BaseModel):
    """A selected component: its name and its validated options (the component's own model)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    options: Any = None


class ModelSection(_Strict):
    """The policy model and its family."""

    path: str
    family: Selection | None = None
    accept_unverified_family: bool = False


class TeacherSection(_Strict):
    """A teacher model for on-policy distillation, served by its own engine(s): it scores the
    tokens the policy samples (their log-probs under the teacher) while groups are generated.
    It must share the policy's tokenizer; its weights never change."""

    path: str
    engine: Selection | None = None


class EvalSection(_Strict):
    """Held-out evaluation, before training, every ``every`` steps and at the end: greedy
    decoding on ``data``'s first ``limit`` prompts, scored by the run's reward (1.0 = correct);
    and, with ``loss_data``, the policy's mean negative log-likelihood of the trained tokens of
    its first ``limit`` records, made into samples by the run's rollout function (one that does
    not generate, such as ``sft``: held-out conversations)."""

    data: Selection | None = None
    loss_data: Selection | None = None
    rollout_function: Selection | None = None
    limit: int = Field(100, ge=1, description="held-out prompts (and loss_data records)")
    every: int = Field(0, ge=0, description="steps between evaluations; 0 = before and after")
    max_new_tokens: int | None = Field(None, ge=1, description="default: rollout.max_new_tokens")


class FiltersSection(_Strict):
    """Group and sample filters, applied in order."""

    group: list[Selection] = Field(default_factory=list)
    sample: list[Selection] = Field(default_factory=list)


class MetricsSection(_Strict):
    """Metric sinks that receive every step's metrics."""

    sinks: list[Selection] = Field(default_factory=list)


class AdapterEntry(BaseModel):
    """One adapter of a run that trains several on one base model (the config's ``adapters``
    list). ``adapter`` is the run's ``adapter`` selection with this entry's ``options`` laid
    over it and ``served_name`` set to ``name``; ``data``, ``reward`` and ``eval_data`` default
    to the run's (``data``, ``reward``, ``eval.data``; when every adapter names its own data or
    reward, the run needs none: the first adapter's stands for it); ``output_dir`` (default
    ``<run dir>/adapters/<name>``) receives the adapter in PEFT's format at every checkpoint
    (``step_<N>/``) and at the end of the run."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    adapter: Selection
    data: Selection | None = None
    reward: Selection | None = None
    eval_data: Selection | None = None
    output_dir: str | None = None


#: what an ``adapters`` entry may hold
ADAPTER_ENTRY_KEYS = ("name", "options", "data", "reward", "eval_data", "output_dir")
#: an adapter's served name: a peft adapter name, an engine's ``lora_path`` and a folder name
ADAPTER_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class RunConfig(BaseModel):
    """A validated run config."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run: RunSection
    model: ModelSection
    backend: Selection
    engine: Selection
    algorithm: Selection
    transport: Selection
    modality: Selection
    reward: Selection
    data: Selection
    rollout: RolloutSection
    rollout_function: Selection | None = None
    loss: Selection | None = None
    router: Selection | None = None
    adapter: Selection | None = None
    #: several adapters trained on one base in one run (each its own data, reward, optimizer,
    #: checkpoint and metrics); empty: the run trains ``adapter`` alone (or the whole model)
    adapters: list[AdapterEntry] = Field(default_factory=list)
    filters: FiltersSection
    eval: EvalSection = Field(default_factory=lambda: EvalSection.model_validate({}))
    teacher: TeacherSection | None = None
    buffer: BufferSection
    metrics: MetricsSection
    plugins: PluginsSection

    def selected(self) -> dict[str, list[str]]:
        """Slot -> selected names, the view compatibility declarations are checked against."""
        out: dict[str, list[str]] = {
            "mode": [self.run.mode],
            "placement": [self.run.placement],
            Kind.SCHEDULE.value: [self.run.mode],
        }
        for spec in SELECTIONS:
            if spec.key == "teacher":
                # The teacher's engine serves the teacher alone; what components declare they
                # run with is the policy's engine.
                continue
            value = getattr(self, spec.key)
            if spec.sub is not None:
                value = getattr(value, spec.sub)
            if isinstance(value, list):
                names = [s.name for s in value]
            else:
                names = [value.name] if value is not None else []
            out.setdefault(spec.kind.value, []).extend(names)
        for entry in self.adapters:
            for kind, sel in (
                (Kind.DATA_SOURCE, entry.data),
                (Kind.REWARD_FUNCTION, entry.reward),
                (Kind.DATA_SOURCE, entry.eval_data),
            ):
                if sel is not None and sel.name not in out.setdefault(kind.value, []):
                    out[kind.value].append(sel.name)
        return out

    def adapter_selections(self) -> list[Selection]:
        """The adapters the trainer is built with: each of ``adapters``, else ``adapter``
        alone, else none (the whole model trains)."""
        if self.adapters:
            return [e.adapter for e in self.adapters]
        return [self.adapter] if self.adapter is not None else []

    def adapter_dirs(self) -> dict[str, Path]:
        """Each of ``adapters``' output folder (resolved), by served name."""
        run_dir = Path(self.run.output_dir).expanduser() / self.run.name
        return {
            e.name: (
                Path(e.output_dir).expanduser() if e.output_dir else run_dir / "adapters" / e.name
            ).resolve()
            for e in self.adapters
        }

    def to_plain(self) -> dict[str, Any]:
        """The resolved config as plain data (selections flattened back to ``{name, ...}``)."""

        def sel(s: Selection | None) -> Any:
            if s is None:
                return None
            opts = s.options.model_dump(mode="json") if isinstance(s.options, BaseModel) else {}
            return {"name": s.name, **opts}

        out: dict[str, Any] = {}
        for key in type(self).model_fields:
            value = getattr(self, key)
            if isinstance(value, Selection) or value is None:
                out[key] = sel(value)
            elif key in _SECTION_SELECTIONS:
                subs = [sub for sub, _ in _SECTION_SELECTIONS[key]]
                out[key] = {
                    **value.model_dump(mode="json", exclude=set(subs)),
                    **{sub: sel(getattr(value, sub)) for sub in subs},
                }
            elif key == "filters":
                out[key] = {
                    "group": [sel(s) for s in value.group],
                    "sample": [sel(s) for s in value.sample],
                }
            elif key == "metrics":
                out[key] = {"sinks": [sel(s) for s in value.sinks]}
            elif key == "adapters":
                out[key] = [
                    {
                        "name": e.name,
                        "adapter": sel(e.adapter),
                        "data": sel(e.data),
                        "reward": sel(e.reward),
                        "eval_data": sel(e.eval_data),
                        "output_dir": e.output_dir,
                    }
                    for e in value
                ]
            else:
                out[key] = value.model_dump(mode="json")
        return out


@dataclass(frozen=True)
class _SelectionSpec:
    """Where in the YAML a component is selected."""

    key: str  # top-level key
    kind: Kind
    required: bool = False
    default: str | None = None
    many: bool = False  # a list of selections
    sub: str | None = None  # key inside the section (filters.group, metrics.sinks, model.family)


SELECTIONS: tuple[_SelectionSpec, ...] = (
    _SelectionSpec("backend", Kind.TRAINER_BACKEND, required=True),
    _SelectionSpec("engine", Kind.ROLLOUT_ENGINE, required=True),
    _SelectionSpec("algorithm", Kind.ALGORITHM, required=True),
    _SelectionSpec("transport", Kind.TRANSPORT, required=True),
    _SelectionSpec("modality", Kind.MODALITY, default="text"),
    _SelectionSpec("reward", Kind.REWARD_FUNCTION, required=True),
    _SelectionSpec("data", Kind.DATA_SOURCE, required=True),
    _SelectionSpec("rollout_function", Kind.ROLLOUT_FUNCTION),
    _SelectionSpec("loss", Kind.LOSS_FUNCTION),
    _SelectionSpec("router", Kind.ROUTER),
    _SelectionSpec("adapter", Kind.ADAPTER),
    _SelectionSpec("filters", Kind.GROUP_FILTER, many=True, sub="group"),
    _SelectionSpec("filters", Kind.SAMPLE_FILTER, many=True, sub="sample"),
    _SelectionSpec("metrics", Kind.METRIC_SINK, many=True, sub="sinks"),
    _SelectionSpec("model", Kind.MODEL_FAMILY, sub="family"),
    _SelectionSpec("eval", Kind.DATA_SOURCE, sub="data"),
    _SelectionSpec("eval", Kind.DATA_SOURCE, sub="loss_data"),
    _SelectionSpec("eval", Kind.ROLLOUT_FUNCTION, sub="rollout_function"),
    _SelectionSpec("teacher", Kind.ROLLOUT_ENGINE, sub="engine"),
)

#: Plain sections that hold selections: section -> (key, kind) of each.
_SECTION_SELECTIONS: dict[str, tuple[tuple[str, Kind], ...]] = {
    key: tuple((s.sub, s.kind) for s in SELECTIONS if s.key == key and s.sub)  # type: ignore[misc]
    for key in ("model", "eval", "teacher")
}

_PLAIN_SECTIONS: dict[str, type[BaseModel]] = {
    "run": RunSection,
    "rollout": RolloutSection,
    "buffer": BufferSection,
    "plugins": PluginsSection,
}
_SECTION_DOCS = {
    "model": "the policy model: path, family, accept_unverified_family",
    "filters": "group and sample filters",
    "metrics": "metric sinks",
    "teacher": "a distillation teacher served by its own engine: path, engine (default: the run's)",
}
TOP_LEVEL_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys([*_PLAIN_SECTIONS, "model", *(s.key for s in SELECTIONS), "adapters"])
)
_DEFAULT_SINKS = ("jsonl",)


# --- reading ---------------------------------------------------------------------------------

#: The most nodes a YAML document may expand to through its aliases (``*name``). A run config
#: has a few hundred; the bound stops an alias bomb (each alias repeating the one before) before
#: it is built in memory.
MAX_YAML_NODES = 100_000


class YamlExpansionError(yaml.YAMLError):
    """A YAML document whose aliases expand past :data:`MAX_YAML_NODES`, or refer to
    themselves."""


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for once every alias is expanded, counted on the
    composed graph (each shared node once per use, memoized: linear in the document), and
    stopped as soon as it passes the bound."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise YamlExpansionError("an alias refers to the node that contains it")
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise YamlExpansionError(
                    f"its aliases (*name) expand it to more than {MAX_YAML_NODES} values"
                )
        on_path.discard(key)
        sizes[key] = total
        return total

    return size(root)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that measures the composed document before building it."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return self.construct_document(node)


def load_yaml(text: str) -> Any:
    """Parse ``text`` like ``yaml.safe_load``, refusing (:class:`YamlExpansionError`) a
    document whose aliases expand it past :data:`MAX_YAML_NODES` values."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a YAML run config and apply ``path.to.key=value`` overrides (values parsed as YAML)."""
    p = Path(path)
    if not p.is_file():
        raise MilesUserError(f"config file {str(p)!r} does not exist")
    try:
        raw = load_yaml(p.read_text()) or {}
    except YamlExpansionError as exc:
        raise ConfigError([f"refused: {exc}"], source=str(p)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source=str(p)) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            [f"the top level must be a mapping of sections, got {type(raw).__name__}"],
            source=str(p),
        )
    return apply_overrides(raw, overrides)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``a.b.c=value`` applied."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise MilesUserError(f"--set {item!r}: expected path.to.key=value")
        try:
            value = load_yaml(text)
        except YamlExpansionError as exc:
            raise MilesUserError(f"--set {item!r}: refused: {exc}") from None
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if isinstance(child, str) and i == 0:  # `algorithm: grpo` shorthand
                child = {"name": child}
            if child is None:
                child = {}
            if not isinstance(child, dict):
                raise MilesUserError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


# --- validation -------------------------------------------------------------------------------


def _loc(prefix: str, loc: Iterable[Any]) -> str:
    parts = [prefix] if prefix else []
    parts += [f"[{p}]" if isinstance(p, int) else str(p) for p in loc]
    return ".".join(parts).replace(".[", "[")


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return current if isinstance(current, type) else None


def format_validation_error(exc: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    """One line per pydantic error: the field path, what is wrong, what is allowed."""
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        path = _loc(prefix, loc)
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent else "see `miles config schema`"
            lines.append(f"{path}: unknown key {loc[-1]!r}; allowed: {allowed}")
        elif kind == "missing":
            lines.append(f"{path}: required field missing")
        else:
            got = err.get("input")
            lines.append(f"{path}: {err.get('msg')} (got {json.dumps(got, default=str)})")
    return lines


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
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise ConfigError(["the top level must be a mapping of sections"], source=source)
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            problems.append(f"unknown section {key!r}; allowed: {', '.join(TOP_LEVEL_KEYS)}")

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

    # model, eval and teacher: plain sections holding selections (model.family; eval.data...)
    sections: tuple[tuple[str, type[BaseModel]], ...] = (
        ("model", ModelSection),
        ("eval", EvalSection),
        ("teacher", TeacherSection),
    )
    for key, model in sections:
        section_raw = raw.get(key)
        if section_raw is None:
            if key == "model":
                problems.append("model: required section missing (needs at least 'path')")
            elif key == "eval":
                parts[key] = model.model_validate({})
            else:
                parts[key] = None
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

    groups: dict[str, dict[str, list[Selection]]] = {"filters": {}, "metrics": {}}
    for spec in SELECTIONS:
        if spec.key in _SECTION_SELECTIONS:
            continue
        if spec.many:
            section = raw.get(spec.key) or {}
            assert spec.sub is not None
            if not isinstance(section, Mapping):
                problems.append(f"{spec.key}: expected a mapping with '{spec.sub}'")
                continue
            allowed_sub = {s.sub for s in SELECTIONS if s.key == spec.key}
            for k in section:
                if k not in allowed_sub:
                    problems.append(
                        f"{spec.key}: unknown key {k!r}; allowed: {', '.join(sorted(allowed_sub))}"  # type: ignore[arg-type]
                    )
            items = section.get(spec.sub)
            if items is None and spec.kind is Kind.METRIC_SINK:
                items = [n for n in _DEFAULT_SINKS if n in registry.names(Kind.METRIC_SINK)]
            items = items or []
            if not isinstance(items, list):
                problems.append(f"{spec.key}.{spec.sub}: expected a list")
                continue
            chosen = []
            for i, item in enumerate(items):
                s = _select(item, f"{spec.key}.{spec.sub}[{i}]", spec.kind, registry, problems)
                if s is not None:
                    chosen.append(s)
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
    # One installed router is the default (it routes only when a run has several engines);
    # `router: null` routes directly, one engine per route.
    routers = registry.names(Kind.ROUTER)
    if "router" not in raw and len(routers) == 1:
        parts["router"] = _select(routers[0], "router", Kind.ROUTER, registry, problems)
    # An algorithm may name the rollout function it is meant for (sft: conversations from
    # data); it is the default when the config names none.
    algorithm = parts.get("algorithm")
    if parts.get("rollout_function") is None and raw.get("rollout_function") is None and algorithm:
        record = registry.get(Kind.ALGORITHM, algorithm.name)
        name = record.default_rollout_function if isinstance(record, Algorithm) else ""
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
    import re

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


def _adapters_problems(config: RunConfig) -> list[str]:
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


def _components(config: RunConfig, registry: Registry) -> list[Component]:
    out = []
    for slot, names in config.selected().items():
        if slot in ("mode", "placement"):
            continue
        out += [registry.get(Kind(slot), n) for n in names]
    return out


def _capability_problems(config: RunConfig, registry: Registry) -> list[str]:
    """A transport that needs an engine capability the selected engine does not serve."""
    engine = registry.get(Kind.ROLLOUT_ENGINE, config.engine.name)
    transport = registry.get(Kind.TRANSPORT, config.transport.name)
    assert isinstance(engine, RolloutEngine) and isinstance(transport, Transport)
    missing = sorted(transport.engine_capabilities - engine.capabilities)
    if not missing:
        return []
    fits = [
        t.name
        for t in registry.all(Kind.TRANSPORT)
        if isinstance(t, Transport) and t.engine_capabilities <= engine.capabilities
    ]
    serves = ", ".join(sorted(engine.capabilities)) or "none"
    return [
        f"transport {transport.name!r} needs the engine capabilities {missing}, which engine "
        f"{engine.name!r} does not serve (it serves: {serves}); transports it can run with: "
        f"{', '.join(fits) or 'none installed'}"
    ]


def _adapter_problems(config: RunConfig, registry: Registry) -> list[str]:
    """An adapter needs a trainer backend that composes with it and an engine that serves
    what it declares (``lora``: SGLang's LoRA API)."""
    if config.adapter is None:
        return []
    adapter = registry.get(Kind.ADAPTER, config.adapter.name)
    backend = registry.get(Kind.TRAINER_BACKEND, config.backend.name)
    engine = registry.get(Kind.ROLLOUT_ENGINE, config.engine.name)
    assert isinstance(adapter, Adapter) and isinstance(backend, TrainerBackend)
    assert isinstance(engine, RolloutEngine)
    problems = []
    if adapter.name not in backend.adapters:
        takes = [
            b.name
            for b in registry.all(Kind.TRAINER_BACKEND)
            if isinstance(b, TrainerBackend) and adapter.name in b.adapters
        ]
        problems.append(
            f"adapter {adapter.name!r} (adapter.name) does not compose with trainer backend "
            f"{backend.name!r} (backend.name), which takes "
            f"{', '.join(sorted(backend.adapters)) or 'no adapter'}; backends that take "
            f"{adapter.name!r}: {', '.join(takes) or 'none installed'}"
        )
    algorithm = registry.get(Kind.ALGORITHM, config.algorithm.name)
    if len(config.adapters) > 1 and "values" in getattr(algorithm, "needs", ()):
        problems.append(
            f"adapters: algorithm {algorithm.name!r} (algorithm.name) trains a critic, and one "
            f"critic cannot serve {len(config.adapters)} policies; train several adapters with "
            "an algorithm without values (grpo, gspo, reinforce_pp...)"
        )
    if len(config.adapters) > 1 and not backend.multi_adapter:
        able = [
            b.name
            for b in registry.all(Kind.TRAINER_BACKEND)
            if isinstance(b, TrainerBackend) and b.multi_adapter and adapter.name in b.adapters
        ]
        problems.append(
            f"adapters: trainer backend {backend.name!r} (backend.name) trains one adapter at a "
            f"time, and the run lists {len(config.adapters)}; backends that train several: "
            f"{', '.join(able) or 'none installed'}"
        )
    transport = registry.get(Kind.TRANSPORT, config.transport.name)
    assert isinstance(transport, Transport)
    if transport.adapter_capabilities is None:
        able = sorted(
            t.name
            for t in registry.all(Kind.TRANSPORT)
            if isinstance(t, Transport) and t.adapter_capabilities is not None
        )
        problems.append(
            f"transport {transport.name!r} (transport.name) cannot publish an adapter alone; "
            f"transports that can: {', '.join(able) or 'none installed'}"
        )
    else:
        lacking = sorted(transport.adapter_capabilities - engine.capabilities)
        if lacking:
            problems.append(
                f"transport {transport.name!r} publishes an adapter through the engine "
                f"capabilities {lacking}, which engine {engine.name!r} does not serve"
            )
    missing = sorted(adapter.engine_capabilities - engine.capabilities)
    if missing:
        fits = [
            e.name
            for e in registry.all(Kind.ROLLOUT_ENGINE)
            if isinstance(e, RolloutEngine) and adapter.engine_capabilities <= e.capabilities
        ]
        problems.append(
            f"adapter {adapter.name!r} needs the engine capabilities {missing} to serve the "
            f"trained adapter, which engine {engine.name!r} (engine.name) does not serve; "
            f"engines that do: {', '.join(fits) or 'none installed'}"
        )
    return problems


def _teacher_problems(config: RunConfig, registry: Registry) -> list[str]:
    """A teacher's log-probs come from the teacher's engine: an algorithm that needs them needs
    a ``teacher``, a teacher needs an algorithm that uses it, and its engine must score."""
    algorithm = registry.get(Kind.ALGORITHM, config.algorithm.name)
    assert isinstance(algorithm, Algorithm)
    wants = "teacher_logprobs" in algorithm.needs
    if wants and config.teacher is None:
        return [
            f"algorithm {algorithm.name!r} needs teacher_logprobs: add a teacher section "
            "(teacher: {path: <the teacher model>}, served by its own engine; engine: "
            "defaults to the run's)"
        ]
    if config.teacher is None:
        return []
    if not wants:
        users = [
            a.name
            for a in registry.all(Kind.ALGORITHM)
            if isinstance(a, Algorithm) and "teacher_logprobs" in a.needs
        ]
        return [
            f"teacher: algorithm {algorithm.name!r} does not use a teacher's log-probs, so the "
            f"teacher would only cost time; algorithms that do: {', '.join(users) or 'none'}"
        ]
    selection = config.teacher.engine or config.engine
    engine = registry.get(Kind.ROLLOUT_ENGINE, selection.name)
    assert isinstance(engine, RolloutEngine)
    if "input_logprobs" not in engine.capabilities:
        return [
            f"teacher.engine: engine {engine.name!r} does not serve input_logprobs (scoring "
            "tokens it did not generate), which the teacher needs; engines that do: "
            + ", ".join(
                e.name
                for e in registry.all(Kind.ROLLOUT_ENGINE)
                if isinstance(e, RolloutEngine) and "input_logprobs" in e.capabilities
            )
        ]
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


def _backend_and_engine_problems(
    config: RunConfig,
    registry: Registry,
    feature: str,
    capability: str,
    backend_lacks: str,
    engine_lacks: str,
) -> list[str]:
    """What a run feature lacks when it needs the selected trainer backend's record to say
    ``feature`` and the selected engine to declare ``capability``: "<who> <lacks>; <those>
    that do: ...", naming the installed ones that do."""
    backend = registry.get(Kind.TRAINER_BACKEND, config.backend.name)
    engine = registry.get(Kind.ROLLOUT_ENGINE, config.engine.name)
    assert isinstance(backend, TrainerBackend) and isinstance(engine, RolloutEngine)
    problems = []
    if not getattr(backend, feature):
        able = [
            b.name
            for b in registry.all(Kind.TRAINER_BACKEND)
            if isinstance(b, TrainerBackend) and getattr(b, feature)
        ]
        problems.append(
            f"trainer backend {backend.name!r} (backend.name) {backend_lacks}; backends that "
            f"do: {', '.join(able) or 'none installed'}"
        )
    if capability not in engine.capabilities:
        able = [
            e.name
            for e in registry.all(Kind.ROLLOUT_ENGINE)
            if isinstance(e, RolloutEngine) and capability in e.capabilities
        ]
        problems.append(
            f"engine {engine.name!r} (engine.name) {engine_lacks}; engines that do: "
            f"{', '.join(able) or 'none installed'}"
        )
    return problems


def _routing_problems(config: RunConfig, registry: Registry) -> list[str]:
    """``rollout.routing`` needs an MoE model, an engine that returns the routing and a
    trainer backend that takes it."""
    mode = config.rollout.routing
    if mode == "none":
        return []
    problems = [
        f"rollout.routing {mode!r}: {p}"
        for p in _backend_and_engine_problems(
            config,
            registry,
            "routing",
            "routed_experts",
            "does not take the engine's MoE routing record",
            "does not return the routed experts",
        )
    ]
    path = Path(config.model.path).expanduser() / "config.json"
    try:
        layers = moe_layers(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        problems.append(
            f"rollout.routing {mode!r}: cannot tell whether model.path is a mixture-of-experts "
            f"model: {path} is not readable JSON ({exc})"
        )
    else:
        if not layers:
            problems.append(
                f"rollout.routing {mode!r}: model.path {config.model.path!r} has no "
                "mixture-of-experts layer (its config.json names no experts and top-k), so "
                "there is no routing to record or replay; set rollout.routing: none"
            )
    return problems


def _true_on_policy_problems(config: RunConfig, registry: Registry) -> list[str]:
    """``rollout.true_on_policy`` needs an engine and a backend that run the batch-invariant
    kernels, a model those cover, and a loop whose trained tokens all come from the trainer's
    current weights."""
    if not config.rollout.true_on_policy:
        return []
    what = "rollout.true_on_policy"
    problems = [
        f"{what}: {p}"
        for p in _backend_and_engine_problems(
            config,
            registry,
            "true_on_policy",
            "true_on_policy",
            "has no batch-invariant forward",
            "has no batch-invariant kernels matching a trainer's",
        )
    ]
    if config.run.mode != "sync":
        problems.append(
            f"{what}: run.mode {config.run.mode!r} trains tokens generated under older weights, "
            "which differ from the trainer's by design; use run.mode: sync"
        )
    if config.adapter_selections():
        problems.append(f"{what}: adapters (LoRA) are not covered by the batch-invariant kernels")
    if config.rollout.routing != "none":
        problems.append(
            f"{what}: the trainer's routers compute the engine's expert choices bitwise, so "
            "there is no routing record to replay; set rollout.routing: none"
        )
    from miles_core.invariant import unsupported

    path = Path(config.model.path).expanduser() / "config.json"
    try:
        why = unsupported(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        why = f"{path} is not readable JSON ({exc})"
    if why:
        problems.append(f"{what}: model.path {config.model.path!r}: {why}")
    return problems


def _needs_problems(config: RunConfig, registry: Registry) -> list[str]:
    """An algorithm that needs an input (a critic's values, a reference's log-probs) the
    selected trainer backend declares it cannot compute; a teacher's log-probs come with the
    samples (:data:`FROM_SAMPLES`), see :func:`_teacher_problems`."""
    backend = registry.get(Kind.TRAINER_BACKEND, config.backend.name)
    algorithm = registry.get(Kind.ALGORITHM, config.algorithm.name)
    assert isinstance(backend, TrainerBackend) and isinstance(algorithm, Algorithm)
    if backend.computes is None:
        return []
    needs = algorithm.needs - FROM_SAMPLES
    missing = sorted(needs - backend.computes)
    if not missing:
        return []
    fits = [
        b.name
        for b in registry.all(Kind.TRAINER_BACKEND)
        if isinstance(b, TrainerBackend) and b.computes is not None and needs <= b.computes
    ]
    computes = ", ".join(sorted(backend.computes)) or "none"
    return [
        f"algorithm {algorithm.name!r} needs {', '.join(missing)}, which trainer backend "
        f"{backend.name!r} (backend.name) does not compute (it computes: {computes}); "
        f"backends that do: {', '.join(fits) or 'none installed'}"
    ]


def rollout_function_name(config: RunConfig, registry: Registry) -> str:
    """The run's rollout function: the config's (an algorithm's default is resolved into the
    config when it is validated), else the modality's default; empty when there is none."""
    if config.rollout_function is not None:
        return config.rollout_function.name
    modality = registry.get(Kind.MODALITY, config.modality.name)
    return modality.default_rollout_function if isinstance(modality, Modality) else ""


def _generates(registry: Registry, name: str) -> bool:
    record = registry.get(Kind.ROLLOUT_FUNCTION, name)
    return not isinstance(record, RolloutFunction) or record.generates


def eval_rollout_function(config: RunConfig, registry: Registry) -> Selection | None:
    """The rollout function the held-out evaluation generates with: ``eval.rollout_function``,
    else the run's when it generates, else the modality's default; ``None`` when none fits."""
    if config.eval.rollout_function is not None:
        return config.eval.rollout_function
    name = rollout_function_name(config, registry)
    if name and _generates(registry, name):
        return config.rollout_function or Selection(name=name)
    modality = registry.get(Kind.MODALITY, config.modality.name)
    default = modality.default_rollout_function if isinstance(modality, Modality) else ""
    if default and _generates(registry, default):
        return Selection(name=default)
    return None


def _eval_problems(config: RunConfig, registry: Registry) -> list[str]:
    """What the held-out evaluation needs of the run's rollout functions."""
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


def check_compatibility(
    config: RunConfig, registry: Registry, *, source: str | None = None
) -> None:
    """Refuse combinations that cannot run, with the reason and who declared it."""
    problems: list[str] = []
    problems.extend(_capability_problems(config, registry))
    problems.extend(_needs_problems(config, registry))
    problems.extend(_adapter_problems(config, registry))
    problems.extend(_adapters_problems(config))
    problems.extend(_teacher_problems(config, registry))
    problems.extend(_routing_problems(config, registry))
    problems.extend(_true_on_policy_problems(config, registry))
    problems.extend(_eval_problems(config, registry))
    selected = config.selected()
    for component in _components(config, registry):
        who = f"{component.kind.label} {component.name!r}"
        for slot, allowed in component.requires.items():
            have = selected.get(slot, [])
            if not any(n in allowed for n in have):
                problems.append(
                    f"{who} requires {slot} in {{{', '.join(allowed)}}}; "
                    f"the config selects {', '.join(have) or 'none'}"
                )
        for slot, banned in component.excludes.items():
            clash = [n for n in selected.get(slot, []) if n in banned]
            if clash:
                problems.append(f"{who} cannot run with {slot} {', '.join(clash)}")
        if component.check is not None:
            reason = component.check(config)
            if reason:
                problems.append(f"{who}: {reason}")
    if problems:
        raise IncompatibleError(problems, source=source)


# --- schema -----------------------------------------------------------------------------------


def _selection_schema_model(kind: Kind, registry: Registry) -> Any:
    variants = []
    for component in registry.all(kind):
        base = component.config or _Strict
        variants.append(
            create_model(
                f"{kind.value}__{component.name}".replace("-", "_").replace(".", "_"),
                __base__=base,
                name=(Literal[component.name], ...),  # type: ignore[valid-type,arg-type]
            )
        )
    if not variants:
        return dict[str, Any]
    union: Any = variants[0]
    for v in variants[1:]:
        union = union | v
    return union


def json_schema(registry: Registry) -> dict[str, Any]:
    """JSON schema of a run config given the installed components."""
    fields: dict[str, Any] = {}
    for key, model in _PLAIN_SECTIONS.items():
        fields[key] = (model, None)
    family = _selection_schema_model(Kind.MODEL_FAMILY, registry)
    fields["model"] = (
        create_model(
            "model",
            __base__=_Strict,
            path=(str, ...),
            family=(family | None, None),
            accept_unverified_family=(bool, False),
        ),
        ...,
    )
    data = _selection_schema_model(Kind.DATA_SOURCE, registry)
    fields["eval"] = (
        create_model(
            "eval",
            __base__=_Strict,
            data=(data | None, None),
            loss_data=(data | None, None),
            rollout_function=(
                _selection_schema_model(Kind.ROLLOUT_FUNCTION, registry) | None,
                None,
            ),
            limit=(int, 100),
            every=(int, 0),
            max_new_tokens=(int | None, None),
        ),
        None,
    )
    fields["teacher"] = (
        create_model(
            "teacher",
            __base__=_Strict,
            path=(str, ...),
            engine=(_selection_schema_model(Kind.ROLLOUT_ENGINE, registry) | None, None),
        )
        | None,
        None,
    )
    for spec in SELECTIONS:
        if spec.key in _SECTION_SELECTIONS or spec.many:
            continue
        sel = _selection_schema_model(spec.kind, registry)
        fields[spec.key] = (sel, ...) if spec.required else (sel | None, None)
    for key in ("filters", "metrics"):
        subs = {
            s.sub: (list[_selection_schema_model(s.kind, registry)], None)  # type: ignore[misc]
            for s in SELECTIONS
            if s.key == key and s.sub
        }
        fields[key] = (create_model(key, __base__=_Strict, **subs), None)  # type: ignore[call-overload]
    adapters_entry: Any = create_model(
        "adapters_entry",
        __base__=_Strict,
        name=(str, ...),
        options=(dict[str, Any] | None, None),
        data=(data | None, None),
        reward=(_selection_schema_model(Kind.REWARD_FUNCTION, registry) | None, None),
        eval_data=(data | None, None),
        output_dir=(str | None, None),
    )
    fields["adapters"] = (list[adapters_entry] | None, None)
    model = create_model("MilesRunConfig", __base__=_Strict, **fields)
    schema = model.model_json_schema()
    schema["title"] = "Miles run config"
    return schema
