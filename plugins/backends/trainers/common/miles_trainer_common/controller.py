"""The trainer object the loop talks to (``miles_core.contracts.Trainer``), the same for every
backend and any world size: world size 1 runs the backend's rank class in this process (on a
real one-rank process group), world size N drives N spawned ranks (:mod:`.processes`).

A backend subclasses :class:`TrainerController`, naming its rank class and its short name, and
overrides :meth:`~TrainerController.check` for what it refuses before any rank starts."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

from miles_core.contracts import AlgorithmImpl
from miles_core.data import Group
from miles_trainer_common.batch import pack, token_batch
from miles_trainer_common.logprobs import set_expert_agreement, set_trainer_logprobs
from miles_trainer_common.processes import ProcessWorkers
from miles_trainer_common.rank import check_algorithm
from miles_trainer_common.ranks import RankLauncher, Ranks, RankServer, rank_spec, resolve


def pick_adapter(adapters: list[Any], name: str | None, backend: str) -> Any:
    """The adapter of ``adapters`` called ``name``; ``None``: the only one. Raises, naming
    the adapters there are, for an unknown name, for ``None`` among several, or when there is
    none."""
    if not adapters:
        raise ValueError(f"the {backend} trainer has no adapter (it trains the whole model)")
    if name is None:
        if len(adapters) > 1:
            raise ValueError(
                f"the {backend} trainer holds adapters {', '.join(a.name for a in adapters)}: "
                "name the one wanted"
            )
        return adapters[0]
    for a in adapters:
        if a.name == name:
            return a
    raise ValueError(
        f"the {backend} trainer has no adapter {name!r}; it has "
        f"{', '.join(a.name for a in adapters)}"
    )


def by_adapter(groups: list[Group], adapters: list[Any], backend: str) -> dict[str, list[int]]:
    """The indices of ``groups`` per adapter name, adapters in order of first appearance.
    A group's ``adapter`` must name one of ``adapters``; ``None`` is allowed only when there
    is exactly one (it is that one). Without adapters every group must name none: the result
    is then ``{"": all indices}``."""
    names = [a.name for a in adapters]
    out: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        name = group.adapter
        if not adapters:
            if name is not None:
                raise ValueError(
                    f"group {i} names adapter {name!r}, and the {backend} trainer has no "
                    "adapter (it trains the whole model)"
                )
            name = ""
        elif name is None:
            if len(adapters) > 1:
                raise ValueError(
                    f"group {i} names no adapter, and the {backend} trainer holds "
                    f"{', '.join(names)}: each group must name the adapter it trains"
                )
            name = names[0]
        elif name not in names:
            raise ValueError(
                f"group {i} names adapter {name!r}, which the {backend} trainer does not "
                f"hold; it has {', '.join(names)}"
            )
        out.setdefault(name, []).append(i)
    return out


#: the metrics of a multi-adapter step that are totals over its adapters (unprefixed)
TOTALS = ("step_time_s", "tokens", "response_tokens", "tokens_per_s", "step")


def train_by_adapter(
    groups: list[Group],
    adapters: list[Any],
    backend: str,
    train_on: Callable[[list[Group], str, float], dict[str, float]],
    activate: Callable[[str], None],
) -> dict[str, float]:
    """A train step's updates, its metrics without ``step`` (the worker counts the step).
    Without adapters or with one: one ``train_on(groups, key, start)`` (``key``: the adapter's
    name, "" for the whole model; ``start``: when the step began). With several: one update
    per adapter the groups name (:func:`by_adapter`), in order of first appearance, on its
    groups alone after ``activate(name)``; an adapter no group names is left untouched. The
    metrics are then each adapter's as ``<name>/<key>``, and the totals :data:`TOTALS`
    unprefixed."""
    start = time.perf_counter()
    split = by_adapter(groups, adapters, backend)
    if len(adapters) <= 1:
        return train_on(groups, next(iter(split)), start)
    metrics: dict[str, float] = {}
    tokens = response_tokens = 0.0
    for name, indices in split.items():
        activate(name)
        part = train_on([groups[i] for i in indices], name, time.perf_counter())
        tokens += part["tokens"]
        response_tokens += part["response_tokens"]
        metrics.update({f"{name}/{k}": v for k, v in part.items()})
    elapsed = time.perf_counter() - start
    metrics.update(
        {
            "step_time_s": elapsed,
            "tokens": tokens,
            "response_tokens": response_tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        }
    )
    return metrics


class TrainerController:
    """A trainer backend's ``Trainer``, over the ranks of class :attr:`worker`.

    Attributes:
        weight_version: incremented by every :meth:`train_step` (restored by :meth:`load`).
        extra: an opaque dict saved with every checkpoint and restored by :meth:`load` (the
            loop keeps its data position and ledger there).
    """

    #: the backend's short name, in messages and process names
    name = "trainer"
    #: ``"module:Class"`` of the rank, built as ``Class(options, rank, world_size, store)``
    worker = ""
    #: ``"module:Class"`` of the options model the spawned ranks validate (None: the type of
    #: the options given)
    options_cls: str | None = None
    #: the algorithm inputs (``needs``) the backend's ranks compute (:meth:`check_algorithm`)
    supported_needs: frozenset[str] = frozenset()

    def __init__(
        self,
        options: Any,
        adapter: Any = None,
        adapters: Any = None,
        routing: str = "none",
        true_on_policy: bool = False,
        ranks: RankLauncher | None = None,
    ) -> None:
        self.options = options
        #: what starts the ranks: a placement's launcher (every world size runs through it,
        #: e.g. one Ray actor per rank), or ``None``: world size 1 in this process, N > 1 as
        #: spawned processes of this machine (:class:`ProcessWorkers`)
        self.ranks = ranks
        if routing not in ("none", "record", "replay"):
            raise ValueError(f"routing {routing!r}; allowed: none, record, replay")
        #: the run's ``rollout.true_on_policy``: each rank is built with
        #: ``true_on_policy=True`` (its forward runs the batch-invariant kernels, and a step
        #: whose recomputed log-probs differ from the engine's fails)
        self.true_on_policy = true_on_policy
        if true_on_policy and (adapter is not None or adapters):
            raise ValueError(
                f"the {self.name} trainer: true on-policy mode does not cover adapters (LoRA)"
            )
        #: the run's ``rollout.routing``: with ``record`` or ``replay`` every sample must carry
        #: the engine's routing record, and each rank is built with ``routing=``
        self.routing = routing
        if adapter is not None and adapters is not None:
            raise ValueError(f"the {self.name} trainer takes adapter= or adapters=, not both")
        #: the run's adapters (``miles_core.contracts.AdapterImpl``), in order; empty: the
        #: whole model trains. Each rank is built with them as ``adapters=`` (copies,
        #: pickled, in a spawned rank). ``adapter=x`` is ``adapters=[x]``.
        self.adapters: list[Any] = (
            list(adapters) if adapters is not None else [adapter] if adapter is not None else []
        )
        names = [a.name for a in self.adapters]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"the {self.name} trainer's adapters need distinct names (served_name); "
                f"{', '.join(map(repr, repeated))} is given more than once"
            )
        self.weight_version = 0
        self.extra: dict[str, Any] = {}
        self._local: Any = None
        self._workers: Ranks | None = None

    @property
    def adapter(self) -> Any:
        """The only adapter, ``None`` without one; with several, an error (see
        :attr:`adapters`)."""
        if len(self.adapters) > 1:
            raise AttributeError(
                f"the {self.name} trainer holds {len(self.adapters)} adapters "
                f"({', '.join(a.name for a in self.adapters)}): use .adapters"
            )
        return self.adapters[0] if self.adapters else None

    def adapter_named(self, name: str | None) -> Any:
        """The adapter called ``name``; ``None``: the only one (:func:`pick_adapter`)."""
        return pick_adapter(self.adapters, name, self.name)

    # --- what a backend adds --------------------------------------------------------------

    def check(self, model_path: str) -> None:
        """Refuse a model or a layout before any rank starts: by default an adapter with
        dropout (the ranks run the model in eval mode: the log-probs the gradient is taken at
        must equal the recomputed ones, so dropout would never apply)."""
        for adapter in self.adapters:
            config = adapter.engine_config()
            if config.get("lora_dropout"):
                raise ValueError(
                    f"adapter.dropout {config['lora_dropout']}: the {self.name} backend runs "
                    "the model in eval mode (the log-probs the gradient is taken at must equal "
                    "the recomputed ones), so the adapter's dropout would never apply; set it "
                    f"to 0 (adapter {adapter.name!r})"
                )

    def check_algorithm(self, algorithm: AlgorithmImpl) -> None:
        """Refuse an algorithm whose inputs the backend cannot compute
        (:attr:`supported_needs`), or a critic with several adapters
        (:func:`miles_trainer_common.rank.check_algorithm`)."""
        check_algorithm(algorithm, self.supported_needs, self.name, len(self.adapters))

    def export_model(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """The whole policy as plain Hugging Face weights, the adapter named ``adapter``
        (``None``: the only one) merged in (``W + scaling * B @ A``), no other adapter, one
        tensor at a time; without an adapter, as :meth:`export_weights`."""
        return self._export("export_model", **self._adapter_kwargs(adapter))

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """The adapter named ``adapter`` (``None``: the only one) in PEFT's format under the
        folder ``path`` (``adapter_model.safetensors``, ``adapter_config.json``), loadable by
        ``peft.PeftModel.from_pretrained(base, path)``."""
        if not self.adapters:
            raise RuntimeError(
                f"save_adapter: this {self.name} trainer was built without an adapter"
            )
        self._call("save_adapter", path, **self._adapter_kwargs(adapter))

    def compute_values(self, groups: list[Group]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens (beyond the contract; no
        grad, on CPU, 0 on padding); the critic is built first if no step has needed it."""
        pack(groups)
        values: Tensor = self._call("compute_values", groups)
        return values

    # --- plumbing -------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args, **kwargs)
        if self._workers is not None:
            return self._workers.call(method, *args, **kwargs)[0]
        raise RuntimeError(f"the {self.name} trainer is not set up: call setup(model_path) first")

    def close(self) -> None:
        """Stop the ranks, then release what their launcher holds (a placement's); the
        trainer cannot be used after."""
        try:
            if self._workers is not None:
                self._workers.close()
                self._workers = None
            self._local = None
        finally:
            if self.ranks is not None:
                self.ranks.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the contract -----------------------------------------------------------------------

    def setup(self, model_path: str) -> None:
        """:meth:`check`, then build every rank's part of the model and its optimizer."""
        if self._local is not None or self._workers is not None:
            raise RuntimeError(f"the {self.name} trainer is already set up")
        self.check(model_path)
        kwargs: dict[str, Any] = {"adapters": self.adapters} if self.adapters else {}
        if self.routing != "none":
            kwargs["routing"] = self.routing
        if self.true_on_policy:
            kwargs["true_on_policy"] = True
        if self.ranks is None and self.options.world_size == 1:
            local = resolve(self.worker)(self.options, 0, 1, **kwargs)
            local.setup(model_path)
            self._local = local
            return
        spec = rank_spec(
            self.options,
            worker=self.worker,
            name=self.name,
            options_cls=self.options_cls,
            worker_kwargs=kwargs,
        )
        workers = self.ranks(spec, RankServer) if self.ranks is not None else ProcessWorkers(spec)
        try:
            workers.call("setup", model_path)
        except BaseException:
            workers.close(graceful=False)
            raise
        self._workers = workers
        # A trainer dropped without close() still stops its processes.
        weakref.finalize(self, workers.close, False)

    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]:
        """Log-probs and entropies ``[B, T]`` of the response tokens (teacher forcing, no
        grad), samples in group order, on CPU; 0 on padding."""
        pack(groups)  # malformed input is refused here, before any rank runs
        by_adapter(groups, self.adapters, self.name)
        lp, ent = self._call("compute_logprobs", groups)
        return lp, ent

    def train_step(self, groups: list[Group], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One optimizer step on ``groups`` with ``algorithm``'s advantages and loss; returns
        the algorithm's metrics plus ``grad_norm``, ``lr``, ``tokens_per_s``, ``step_time_s``,
        ``micro_batches``, ``weight_version``... With several adapters, each group trains the
        adapter it names (:func:`by_adapter`), one step per adapter, whose metrics come as
        ``<name>/<key>`` beside the totals (a backend's rank says which). Every sample's
        ``trainer_logprobs`` is then set: the log-probs the step computed before its update;
        with ``routing``, its ``trainer_expert_agreement`` too, from the same forward."""
        self.check_algorithm(algorithm)
        packed = pack(groups)
        token_batch(packed)
        if self.routing != "none" and packed.routed_experts is None:
            raise ValueError(
                f"rollout.routing {self.routing!r}: the samples carry no routing record "
                "(routed_experts) of the engine; a run that replays the routing never trains "
                "on a sample without it (did the rollout function keep the engine's "
                "routed_experts?)"
            )
        by_adapter(groups, self.adapters, self.name)
        metrics: dict[str, float] = self._call("train_step", groups, algorithm)
        logprobs, agreement = self._call("trained_logprobs")
        set_trainer_logprobs(groups, logprobs)
        set_expert_agreement(groups, agreement)
        self.weight_version += 1
        metrics["weight_version"] = float(self.weight_version)
        return metrics

    def export_weights(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """Every (Hugging Face state-dict name, whole tensor), one at a time: the next tensor
        is gathered only when the consumer asks for it. With adapters, the tensors of the
        adapter named ``adapter`` alone (``None``: the only one), in PEFT's names: what the
        engines load."""
        return self._export("export_tensors", **self._adapter_kwargs(adapter))

    def _adapter_kwargs(self, adapter: str | None) -> dict[str, Any]:
        """``{"adapter": name}`` for a rank's method, after checking the name here (nothing
        when the trainer has no adapter and none is named)."""
        if adapter is None and not self.adapters:
            return {}
        return {"adapter": self.adapter_named(adapter).name}

    def _export(self, method: str, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """Stream the ranks' ``method`` (a collective generator of (name, full tensor))."""
        if self._local is not None:
            result: Iterator[tuple[str, Tensor]] = getattr(self._local, method)(**kwargs)
            return result
        if self._workers is not None:
            return self._workers.export(method, **kwargs)
        raise RuntimeError(f"the {self.name} trainer is not set up: call setup(model_path) first")

    def fingerprint(self) -> dict[str, str]:
        """sha256 of the whole weights (``weights``) and of the optimizer, schedule and step
        (``optimizer``): equal fingerprints mean bitwise-equal training state."""
        result: dict[str, str] = self._call("fingerprint")
        return result

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Save model, optimizer, LR schedule, RNG states, step, weight version and
        :attr:`extra` (replaced by ``extra`` when given) under the folder ``path``."""
        if extra is not None:
            self.extra = dict(extra)
        self._call("save", path, self.extra, self.weight_version)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save` (after :meth:`setup`); the next step
        is bitwise the one the saved trainer would have taken."""
        extra, version = self._call("load", path)
        self.extra = extra
        self.weight_version = version

    def sleep(self) -> None:
        """Free gradients and, on a GPU, move parameters and optimizer state to the CPU."""
        self._call("sleep")

    def wake(self) -> None:
        """Bring back what :meth:`sleep` moved."""
        self._call("wake")
