"""The run config's schema: the core's sections (pydantic models), the validated
:class:`RunConfig`, and where in the YAML each component is selected."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_core.components import Kind


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
    admission: bool = Field(
        False,
        description="start a prompt's group only when it can be taken within max_staleness "
        "given the groups buffered and in flight ahead of it, the trainer taking the oldest "
        "weights first (the discard at removal stays as the last resort); false starts every "
        "group a free slot allows and takes groups in arrival order",
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


class TracesSection(_Strict):
    """Per-rollout traces: a bounded sample of each step's trained groups written to
    ``<run dir>/traces.jsonl`` (one JSON line per sample: its texts, reward, and per token the
    engine's and the trainer's log-probs and the weight version)."""

    groups_per_step: int = Field(
        2, ge=0, description="groups traced per traced step (the first ones trained); 0 = off"
    )
    every: int = Field(1, ge=0, description="steps between traced steps; 0 = off")
    max_tokens_per_sample: int = Field(
        256,
        ge=1,
        description="response tokens kept per traced sample (the first ones; the rest counted "
        "as cut in the line)",
    )
    max_bytes_per_step: int = Field(
        65536,
        ge=1024,
        description="hard cap on a step's trace lines, in bytes: tokens are cut first (each "
        "sample's tail), then whole samples; what was cut is counted in the lines",
    )


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
    traces: TracesSection = Field(default_factory=lambda: TracesSection.model_validate({}))

    def selected(self) -> dict[str, list[str]]:
        """Slot -> selected names, the view compatibility declarations are checked against."""
        out: dict[str, list[str]] = {
            "mode": [self.run.mode],
            "placement": [self.run.placement],
            Kind.SCHEDULE.value: [self.run.mode],
        }
        for spec in SELECTIONS:
            if not spec.policy:
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
    #: a part of the policy's run, checked against what components declare they run with;
    #: the teacher's engine serves the teacher alone
    policy: bool = True


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
    _SelectionSpec("teacher", Kind.ROLLOUT_ENGINE, sub="engine", policy=False),
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
    "traces": TracesSection,
}
_SECTION_DOCS = {
    "model": "the policy model: path, family, accept_unverified_family",
    "filters": "group and sample filters",
    "metrics": "metric sinks",
    "teacher": "a distillation teacher served by its own engine: path, engine (default: the run's)",
}
#: plain sections named after the selections where the top-level keys are listed (the later
#: additions, so that the list a user already knows keeps its order)
_LISTED_LAST = ("traces",)
TOP_LEVEL_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            *(k for k in _PLAIN_SECTIONS if k not in _LISTED_LAST),
            "model",
            *(s.key for s in SELECTIONS),
            "adapters",
            *_LISTED_LAST,
        ]
    )
)
_DEFAULT_SINKS = ("jsonl",)
