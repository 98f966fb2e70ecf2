"""What the loop asks of algorithms, trainer backends and adapters. Tensor types are named
as strings: this module imports no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.data import Group

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor
else:
    Tensor = Any


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
    #: [B, T] each generated turn's reward (``Sample.turn_rewards``) on the turn's last trained
    #: token, 0 elsewhere; ``None`` when no sample of the batch has turn rewards
    turn_rewards: Tensor | None = None
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


@runtime_checkable
class Trainer(Protocol):
    """A trainer backend instance: owns the policy being trained."""

    weight_version: int

    def setup(self, model_path: str) -> None: ...

    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]: ...

    def train_step(self, groups: list[Group], algorithm: AlgorithmImpl) -> dict[str, float]: ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's (Hugging Face name, whole tensor) pairs, one at a time: what the
        engines load. A tensor that another name already gave is left out
        (:func:`each_tensor_once`: a tied head is sent as the embedding alone)."""
        ...

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


def each_tensor_once(state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of a ``state_dict(keep_vars=True)``, a tensor that another name
    already gave left out: a tied head (``lm_head.weight``, the embedding itself) is exported
    under the embedding's name alone, as Hugging Face's ``save_pretrained`` writes it. The
    engines tie it again on load (SGLang skips a tied ``lm_head.weight`` anyway), so a sync of
    a tied model sends the embedding once."""
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor
