"""The runtime interfaces that the objects built by components implement.

A component record (:mod:`miles_core.components`) says *what* a plugin provides; the protocols
here say *how the loop talks to it*. They are structural (``typing.Protocol``): a plugin needs
no base class. Tensor types are named as strings so this module, like the whole core, imports
no torch. Each kind's contract tests live in :mod:`miles_core.testing.contracts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.data import Group, Sample

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor
else:
    Tensor = Any


# --- user extension points -------------------------------------------------------------------


@runtime_checkable
class RewardFn(Protocol):
    """Scores one finished sample. Returns the reward; may also write details into
    ``sample.metadata``. A raising reward function marks the sample as failed, not the run."""

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float: ...


@runtime_checkable
class SampleFilterFn(Protocol):
    """Returns True to keep a sample (applied before its group is judged)."""

    def __call__(self, sample: Sample) -> bool: ...


@runtime_checkable
class GroupFilterFn(Protocol):
    """Returns True to keep a group; a dropped group is recorded in the ledger as ``filtered``."""

    def __call__(self, group: Group) -> bool: ...


@runtime_checkable
class PromptSource(Protocol):
    """An endless or finite stream of prompt records (dicts with at least ``prompt`` or
    ``messages``), resumable from its state."""

    #: malformed rows skipped so far (reported as ``data/skipped_rows``)
    skipped: int

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class MetricWriter(Protocol):
    """Receives the metrics of every step; ``open`` is called once with the run's folder."""

    def open(self, run_dir: str) -> None: ...

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class RolloutFn(Protocol):
    """Generates and scores one group for one prompt record on the given engine client.

    ``context`` carries what the loop knows and a rollout may use: ``family`` (the built model
    family: render, tokenize, decode, stop tokens), ``modality`` (the built modality: what a
    sample is, e.g. the diffusion sampler's settings), ``sampling_params`` (from the run
    config's ``rollout`` section), ``step``. Accept ``**context`` and ignore what you do not
    need.
    """

    async def __call__(
        self,
        prompt: Mapping[str, Any],
        *,
        group_size: int,
        engine: Any,
        reward: RewardFn,
        **context: Any,
    ) -> Group: ...


@runtime_checkable
class EngineClient(Protocol):
    """What the core needs of an engine client: a subset of SGLang's native HTTP API, the same
    against a real SGLang server and the embedded engine. The core calls nothing else."""

    #: the server's base URL (``http://host:port``); weight transports publish to it
    base_url: str

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> Any:
        """``POST /generate``; the result has ``output_ids``, ``logprobs``, ``finish_reason``
        (stop / length / abort) and ``weight_version`` (a string; may be empty)."""
        ...

    async def input_logprobs(self, input_ids: Sequence[int], *, start: int) -> list[float]:
        """The log-probs the served model gives the tokens at positions
        ``start..len(input_ids)-1``, each after the tokens before it (``start >= 1``), without
        generating: SGLang's prompt log-probs of ``POST /generate`` (``return_logprob``,
        ``logprob_start_len``, ``max_new_tokens`` 0). How a teacher scores a student's tokens.
        Raises when the engine returns fewer, or a null one."""
        ...

    async def health(self) -> bool:
        """``GET /health``: True when the server answers 200, False when it does not answer or
        answers an error status (a dead or hung engine). Anything else raises."""
        ...

    async def pause_generation(self, mode: str = "abort") -> Any:
        """``POST /pause_generation`` with SGLang's mode: ``abort`` (in-flight requests end with
        finish reason ``abort``), ``retract`` or ``in_place``."""
        ...

    async def continue_generation(self) -> Any:
        """``POST /continue_generation``."""
        ...

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /release_memory_occupation`` (``kv_cache``, ``weights``)."""
        ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /resume_memory_occupation``."""
        ...

    async def get_weight_version(self) -> str | None:
        """The weight version the server reports (``weight_version`` of ``GET /model_info`` in
        SGLang 0.5.23), as a string; ``None`` when it reports none."""
        ...

    async def get_server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (``max_running_requests`` among others)."""
        ...

    async def close(self) -> None:
        """Close the client's connections (the server keeps running)."""
        ...


# --- algorithms -----------------------------------------------------------------------------


@dataclass
class TokenBatch:
    """Padded per-token tensors of a set of whole groups, built by a trainer backend.

    Shapes: ``B`` samples, ``T`` response tokens. Optional fields are filled only when the
    algorithm's ``needs`` asks for them.
    """

    response_mask: Tensor  # [B, T] 1 where trained
    rollout_logprobs: Tensor  # [B, T] the engine's log-probs
    rewards: Tensor  # [B]
    group_index: Tensor  # [B] which group each sample belongs to
    old_logprobs: Tensor | None = None  # [B, T] recomputed behaviour log-probs
    ref_logprobs: Tensor | None = None  # [B, T]
    teacher_logprobs: Tensor | None = None  # [B, T]
    values: Tensor | None = None  # [B, T] critic values at rollout time
    advantages: Tensor | None = None  # [B, T] filled by the algorithm
    returns: Tensor | None = None  # [B, T] filled by estimators that train a critic
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AlgorithmImpl(Protocol):
    """Backend-blind RL algorithm: pure functions of tensors and group metadata."""

    #: The optional TokenBatch inputs these options use (a subset of the record's ``needs``,
    #: which lists what any valid options may use); the loop computes only these.
    needs: frozenset[str]

    def compute_advantages(self, batch: TokenBatch) -> None:
        """Fill ``batch.advantages`` (and ``batch.returns`` when it trains a critic)."""
        ...

    def loss(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """The scalar loss to minimise for the current policy's ``logprobs`` [B, T], with
        metrics (clip fraction, approximate KL, entropy, ratio statistics...)."""
        ...


@runtime_checkable
class LossFn(Protocol):
    """A per-token loss replacing an algorithm's own (signature of ``AlgorithmImpl.loss``)."""

    def __call__(
        self,
        batch: TokenBatch,
        logprobs: Tensor,
        *,
        entropy: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]: ...


# --- trainer backends, engines, transports --------------------------------------------------


@runtime_checkable
class Trainer(Protocol):
    """A trainer backend instance: owns the policy being trained."""

    weight_version: int

    def setup(self, model_path: str) -> None: ...

    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]: ...

    def train_step(self, groups: list[Group], algorithm: AlgorithmImpl) -> dict[str, float]: ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, schedule, RNG and step; ``extra`` is kept as given."""
        ...

    def load(self, path: str) -> None:
        """Restore a :meth:`save`; the saved ``extra`` is then in ``self.extra``."""
        ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None:
        """Release worker processes and process groups."""
        ...


@runtime_checkable
class AdapterImpl(Protocol):
    """A parameter-efficient adapter (LoRA), built from the run config's ``adapter`` (or each
    of ``adapters``) and handed to the trainer backend's factory (``factory(options,
    adapter=obj)``, or ``adapters=[obj, ...]``: one base model holding several). The backend
    calls it on every rank, so it must pickle (spawned ranks receive a copy) and behave the
    same everywhere (its initialisation seeded, not drawn from the run's RNG).

    Weight names: :meth:`named_weights` yields the adapter's tensors with the names PEFT's
    ``get_peft_model_state_dict`` gives (``base_model.model.<module>.lora_A.weight``: no
    adapter-name infix), which SGLang's ``/load_lora_adapter_from_tensors`` takes with
    :meth:`engine_config` as its config. ``full`` turns a tensor of the wrapped model's state
    dict into the whole tensor (a sharded backend's gather; identity by default); every rank
    calls it on the same tensors in the same order.
    """

    #: the name the engines serve the adapter under (``lora_path`` on ``/generate``), also
    #: its name inside a wrapped model that holds several
    name: str
    #: its own learning rate (``None``: the trainer backend's)
    lr: float | None

    def apply(self, model: Any) -> Any:
        """Wrap a Hugging Face causal LM in the adapter, base weights frozen
        (``requires_grad`` False), adapter weights trainable; returns the wrapped model.
        Raises, naming what is wrong, when the model does not fit the adapter's options."""
        ...

    def add_to(self, wrapped: Any) -> Any:
        """Add this adapter to a model another adapter's :meth:`apply` wrapped, leaving the
        adapters already there as they are; returns ``wrapped``."""
        ...

    def activate(self, model: Any) -> None:
        """Make this adapter the one the wrapped model's forward applies; every adapter stays
        trainable (an inactive one gets no gradient) and the base frozen."""
        ...

    def parameters(self, model: Any) -> list[tuple[str, Any]]:
        """This adapter's (name, parameter) pairs of the wrapped model, nothing of the base
        or of another adapter: what its own optimizer steps."""
        ...

    def named_weights(self, model: Any, full: Any = None) -> Iterator[tuple[str, Tensor]]:
        """The adapter's tensors of a wrapped model, (PEFT name, tensor), nothing of the base."""
        ...

    def engine_config(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
        ``peft_type``...), what an engine needs beside the tensors to load it."""
        ...

    def save_pretrained(self, weights: Iterable[tuple[str, Tensor]], path: str) -> None:
        """Write ``weights`` (as :meth:`named_weights` gives them) and :meth:`engine_config`
        to the folder ``path`` in PEFT's format (``adapter_model.safetensors``,
        ``adapter_config.json``), loadable by ``peft.PeftModel.from_pretrained(base, path)``."""
        ...

    def merged_weights(self, model: Any, full: Any = None) -> Iterator[tuple[str, Tensor]]:
        """The plain Hugging Face weights of a wrapped model with the adapter merged in
        (``W + scale * B @ A``), in the base model's names: an export loadable without PEFT."""
        ...


@runtime_checkable
class AdapterTrainer(Trainer, Protocol):
    """A :class:`Trainer` of a backend whose record lists adapters
    (:attr:`~miles_core.components.TrainerBackend.adapters`), built with one: its
    :meth:`Trainer.export_weights` streams the adapter's tensors alone (what is synced), and
    these export the whole model. The core calls them only when the run selects an adapter.

    Built with several (``factory(options, adapters=[...])``, a backend whose record says
    ``multi_adapter``), each group trains the adapter it names (``Group.adapter``) with that
    adapter's own optimizer, an adapter without groups in a step is left exactly as it was,
    and the core names the adapter: ``export_weights(name)``, ``export_model(name)``,
    ``save_adapter(path, name)``."""

    def export_weights(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """The adapter's tensors alone (PEFT's names): the only one, or ``adapter``."""
        ...

    def export_model(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """The whole policy as plain Hugging Face weights, the adapter merged in."""
        ...

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """The adapter in PEFT's format under the folder ``path``
        (:meth:`AdapterImpl.save_pretrained`)."""
        ...


@runtime_checkable
class EngineLauncher(Protocol):
    """Starts and stops engine servers; each server speaks the SGLang-native HTTP API."""

    #: engine servers a run launches (indices ``0 .. num_engines - 1``)
    num_engines: int

    def launch(self, model_path: str, *, index: int) -> str:
        """Start server ``index`` and return its base URL once its health endpoint answers."""
        ...

    def client(self, url: str) -> EngineClient:
        """A client for the server at ``url``."""
        ...

    def stop(self, index: int) -> None:
        """Stop whatever is left of server ``index`` (a dead or hung process, its port);
        a no-op when nothing of it runs."""
        ...

    def shutdown(self) -> None:
        """Stop every server this launcher started."""
        ...


@dataclass(frozen=True)
class AdapterSync:
    """What a transport publishes instead of the model when the run trains an adapter: the
    engines keep their base weights and serve the adapter under ``name`` (the ``lora_path`` of
    generation requests), built from ``config`` (PEFT's ``adapter_config.json`` fields) and the
    adapter's tensors (PEFT names, ``...lora_A.weight`` / ``...lora_B.weight``)."""

    name: str
    config: Mapping[str, Any]


@runtime_checkable
class WeightTransport(Protocol):
    """The trainer side of a weight transport: publishes the trainer's weights to the engines
    through their HTTP API (SGLang's weight-update endpoints, or an engine capability the
    transport's record declares it needs)."""

    def send(
        self,
        weights: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` in bounded buckets to every engine at the base URLs ``engines``
        and have each commit ``version``; returns timing metrics. The set of engines may
        differ from the previous call's (an engine restarted): the transport re-forms what it
        keeps per engine. Raises on timeout or a rejected bucket, leaving the engines on their
        previous version. Pausing and resuming generation around it is the caller's job.

        With ``adapter``, ``weights`` are an adapter's tensors only: each engine replaces the
        adapter ``adapter.name`` with them (loading it if it has none) and keeps its base
        weights. Only a transport whose record declares ``adapter_capabilities`` is given
        one: a run with an adapter and any other transport is refused at start."""
        ...

    def close(self) -> None:
        """Release what the sender holds (groups, buffers, sockets); idempotent."""
        ...


@runtime_checkable
class Router(Protocol):
    """A request router in front of several engines (``sglang-router`` in production):
    generation goes through it, control calls go to each engine directly."""

    def start(self, engines: Sequence[str]) -> str:
        """Start routing over the engines at these base URLs; returns the router's base URL
        (an :class:`EngineClient` built for it generates through the router)."""
        ...

    def set_engines(self, engines: Sequence[str]) -> None:
        """Route over exactly these engines from now on (one left, or came back)."""
        ...

    def alive(self) -> bool:
        """Whether the router process still serves."""
        ...

    def stop(self) -> None:
        """Stop the router (idempotent)."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """The engine side of a weight transport, embedded in each engine."""

    version: int

    def receive(self, target: Any) -> int:
        """Receive one update into ``target`` (a callable taking a list of (name, tensor), or a
        mutable mapping of tensors); returns the committed version. Leaves ``target`` on its
        previous weights when a bucket is rejected or a wait times out."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Schedule(Protocol):
    """How rollout and training interleave; the run takes its batches from it. Its coroutines
    run on the run's I/O event loop, next to the engine fleet."""

    def attach(self, ctx: Any) -> None:
        """Take the run's parts (a :class:`miles_core.runtime.schedules.ScheduleContext`: the
        config, the engine fleet, the rollouts, the judge, the ledger); called once."""
        ...

    async def next_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The whole groups step ``step`` trains on, each already judged and kept, with the
        rollout's metrics (``time/rollout_s`` among them)."""
        ...

    async def publish(self, version: int) -> dict[str, float]:
        """Have the engines serve ``version`` (through the fleet), pausing generation as the
        schedule needs."""
        ...

    async def metrics(self, version: int) -> dict[str, float]:
        """The schedule's own per-step metrics."""
        ...

    async def stop(self) -> None:
        """Stop generating; what is in flight or queued is dropped as ``run_ended``. Raises
        the error of a group that failed after the last batch."""
        ...


# --- model families and modalities ----------------------------------------------------------


@runtime_checkable
class Family(Protocol):
    """A verified pairing of chat template, tool-call parser and reasoning parser."""

    name: str
    #: Roles the template renders and a session may append.
    roles: tuple[str, ...]
    #: Whether assistant turns carry reasoning in this configuration.
    thinking: bool
    stop_token_ids: tuple[int, ...]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text: special tokens as their ids, nothing added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint_parts(self) -> dict[str, str]:
        """sha256 per part (template, template arguments, tokenizer, parsers...), so a stale
        certificate can say what changed; ``fingerprint`` hashes them together."""
        ...

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str: ...

    def parse_assistant(self, text: str) -> dict[str, Any]:
        """Split generated text into content, reasoning and tool calls."""
        ...

    def fingerprint(self) -> str:
        """Hash of template, tokenizer and parsers that a gate certificate is bound to."""
        ...
