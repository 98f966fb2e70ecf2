"""The loop's side of the trainer's actor: a :class:`~miles_core.contracts.Trainer` and a
:class:`~miles_core.contracts.WeightTransport` whose work happens in the actor.

A weight sync stays inside the actor: :meth:`RemoteTrainer.export_weights` returns a
:class:`RemoteWeights` handle, and :meth:`RemoteSender.send` given that handle asks the actor
to feed its trainer's weights to its sender. Iterated anywhere else, the handle streams the
tensors through Ray, so the contract holds for any other consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from miles_core.data import Group

if TYPE_CHECKING:
    from miles_ray.placement import RayPlacement


def _get(ref: Any, what: str, timeout: float | None = None) -> Any:
    """``ray.get`` that names the trainer's actor when the actor itself is gone."""
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(ref, timeout=timeout)
    except RayActorError as exc:
        raise RuntimeError(f"the trainer's Ray actor died during {what}: {exc}") from exc


def _named(adapter: str | None) -> tuple[Any, ...]:
    return () if adapter is None else (adapter,)


class RemoteWeights:
    """The weights of the trainer in ``actor``, not yet moved anywhere: an iterator of
    (name, tensor) that starts streaming them through Ray only when first advanced. ``args``:
    the method's (the adapter's name, for a trainer of several)."""

    def __init__(
        self, actor: Any, method: str = "export_weights", args: tuple[Any, ...] = ()
    ) -> None:
        self.actor = actor
        self.method = method
        self.args = args
        self._refs: Any = None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self

    def __next__(self) -> tuple[str, Any]:
        import ray

        if self._refs is None:
            method = getattr(self.actor, self.method)
            self._refs = method.options(num_returns="streaming").remote(*self.args)
        name, tensor = ray.get(next(self._refs))
        return name, tensor


class RemoteTrainer:
    """A :class:`~miles_core.contracts.Trainer` running in the placement's Ray actor.

    ``weight_version`` and ``extra`` mirror the actor's after every call that changes them.
    Other public methods of the backend (``fingerprint``...) are forwarded as they are.
    """

    def __init__(self, placement: RayPlacement, actor: Any) -> None:
        self.placement = placement
        self.actor = actor
        self.weight_version = 0
        self.extra: dict[str, Any] = {}
        self._algorithm: Any = None

    def where(self) -> dict[str, Any]:
        """Where the trainer runs: pid, host, node, placement group and bundle."""
        info: dict[str, Any] = _get(self.actor.where.remote(), "where")
        info["bundle_index"] = self.placement.layout.trainer_bundle
        return info

    def setup(self, model_path: str) -> None:
        """Build the model in the actor (the path is read on the actor's node)."""
        self.weight_version = int(
            _get(
                self.actor.setup.remote(model_path), "setup", self.placement.options.actor_timeout_s
            )
        )

    def compute_logprobs(self, groups: list[Group]) -> tuple[Any, Any]:
        """The trainer's log-probs and entropies of ``groups``."""
        lp, ent = _get(self.actor.compute_logprobs.remote(groups), "compute_logprobs")
        return lp, ent

    def train_step(self, groups: list[Group], algorithm: Any) -> dict[str, float]:
        """One step in the actor. The algorithm object is sent once and then lives with the
        trainer, so an algorithm that keeps state across steps keeps it there. Each sample's
        ``trainer_logprobs`` and ``trainer_expert_agreement`` are then set from the actor's."""
        if algorithm is not self._algorithm:
            _get(self.actor.set_algorithm.remote(algorithm), "set_algorithm")
            self._algorithm = algorithm
        metrics, version, trained = _get(self.actor.train_step.remote(groups), "train_step")
        self.weight_version = int(version)
        # the actor trained copies of the samples: what it set on them comes back to the loop's
        for group, by_sample in zip(groups, trained, strict=True):
            for sample, (lp, agree) in zip(group.samples, by_sample, strict=True):
                sample.trainer_logprobs, sample.trainer_expert_agreement = lp, agree
        return dict(metrics)

    def export_weights(self, adapter: str | None = None) -> RemoteWeights:
        """A handle on the actor's weights (see the module docstring); ``adapter``: that
        adapter's of a trainer of several."""
        return RemoteWeights(self.actor, "export_weights", _named(adapter))

    def export_model(self, adapter: str | None = None) -> RemoteWeights:
        """A handle on the actor's whole merged model (a trainer with an adapter)."""
        return RemoteWeights(self.actor, "export_model", _named(adapter))

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """Write the adapter in PEFT's format under ``path`` on the actor's node."""
        _get(self.actor.save_adapter.remote(path, *_named(adapter)), "save_adapter")

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Save under ``path`` on the actor's node (shared storage on a multi-node cluster)."""
        if extra is not None:
            self.extra = dict(extra)
        _get(self.actor.save.remote(path, extra), "save")

    def load(self, path: str) -> None:
        """Restore a save; ``extra`` and ``weight_version`` follow."""
        extra, version = _get(self.actor.load.remote(path), "load")
        self.extra, self.weight_version = dict(extra), int(version)

    def sleep(self) -> None:
        """The backend's sleep, in the actor."""
        _get(self.actor.sleep.remote(), "sleep")

    def wake(self) -> None:
        """The backend's wake, in the actor."""
        _get(self.actor.wake.remote(), "wake")

    def close(self) -> None:
        """Close the trainer in its actor, then release the whole placement (the actor, the
        placement group and the engines' bundles, and a local cluster the run started)."""
        self.placement.release()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        actor = self.__dict__.get("actor")
        if actor is None:
            raise AttributeError(name)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return _get(actor.call.remote(name, args, kwargs), name)

        return forward


class RemoteSender:
    """The sending side of the run's transport, living in the trainer's actor: it drives the
    engines' weight-update endpoints from there, so the weights never pass through the driver.
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._closed = False

    def send(
        self,
        weights: Iterable[tuple[str, Any]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: Any = None,
    ) -> dict[str, float]:
        """Stream ``weights`` to the engines at ``engines`` from the actor; the trainer's own
        weights never leave the actor's process on the way. ``adapter`` (an
        :class:`~miles_core.contracts.AdapterSync`) goes to the actor's sender as it is."""
        urls = list(engines)
        if (
            isinstance(weights, RemoteWeights)
            and weights.actor is self.actor
            and weights.method == "export_weights"
        ):
            ref = self.actor.send_weights.remote(version, urls, adapter, weights.args)
        else:
            ref = self.actor.send_tensors.remote(list(weights), version, urls, adapter)
        metrics: dict[str, float] = _get(ref, "a weight sync")
        return metrics

    def close(self) -> None:
        """Close the sender in the actor (idempotent; a dead actor has nothing left to close)."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(self.actor.close_sender.remote(), timeout=60)
        except RayActorError:
            pass
