"""The trainer's Ray actor: builds the selected trainer backend and the transport's sending side
in the actor's process, with the same registry factories a local run uses, and serves the
:class:`~miles_ray.proxy.RemoteTrainer` and :class:`~miles_ray.proxy.RemoteSender` proxies.

The weights go from the trainer straight into the sender inside this process: nothing passes
through the driver.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

from miles_core.components import Kind
from miles_core.registry import Registry, build_trainer


def validated(registry: Registry, kind: Kind, name: str, options: Any) -> Any:
    """Component ``name``'s options from plain data, re-validated here with the component's
    own model, exactly as the run config validated them (``None`` when it takes none)."""
    component = registry.get(kind, name)
    if component.config is None:
        return None
    return component.config.model_validate(options or {})


def build_component(registry: Registry, kind: Kind, name: str, options: Any) -> Any:
    """Build component ``name`` of ``kind`` from its options as plain data."""
    return registry.get(kind, name).build(validated(registry, kind, name, options))


def build_trainer_from(registry: Registry, spec: dict[str, Any]) -> Any:
    """The run's trainer from the spec's ``backend`` (``[name, options]`` as plain data) and
    ``adapters`` (a list of those; absent or empty without one) and ``routing`` (the
    config's ``rollout.routing``; absent: ``none``) and ``true_on_policy`` (the config's
    ``rollout.true_on_policy``; absent: False), the way a local run builds it."""
    name, options = spec["backend"]
    backend_options = validated(registry, Kind.TRAINER_BACKEND, name, options)
    adapters = [(a[0], validated(registry, Kind.ADAPTER, *a)) for a in spec.get("adapters") or []]
    return build_trainer(
        registry,
        name,
        backend_options,
        adapters,
        routing=spec.get("routing") or "none",
        true_on_policy=bool(spec.get("true_on_policy")),
    )


class TrainerHost:
    """The actor's body: one trainer and one weight sender.

    ``spec`` holds ``backend`` and ``transport`` as ``[name, options]``, ``adapters`` as a
    list of those, and the run's plugin
    ``allow`` / ``block`` lists, so this process loads the same plugins as the driver.
    """

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        import ray

        from miles_core.hosts import NODE_ADDRESS_ENV
        from miles_core.plugins import load_plugins

        # the sender's rendezvous binds this node's address; the run's API key reaches here
        os.environ.update(env or {})
        os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()

        plugins = load_plugins(allow=spec.get("allow") or None, block=spec.get("block") or None)
        self.registry = plugins.registry
        self.trainer = build_trainer_from(plugins.registry, spec)
        self.sender: Any = None
        try:
            self.sender = build_component(plugins.registry, Kind.TRANSPORT, *spec["transport"])
        except BaseException:
            self.trainer.close()
            raise
        self.algorithm: Any = None

    def where(self) -> dict[str, Any]:
        """Where this actor runs: pid, host, node and placement group."""
        import ray

        from miles_core.hosts import NODE_ADDRESS_ENV

        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "address": os.environ.get(NODE_ADDRESS_ENV),
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "resources": ctx.get_assigned_resources(),
        }

    def setup(self, model_path: str) -> int:
        """Build the trainer's model; returns its weight version."""
        self.trainer.setup(model_path)
        return int(self.trainer.weight_version)

    def compute_logprobs(self, groups: list[Any]) -> Any:
        """The trainer's log-probs and entropies of ``groups``."""
        return self.trainer.compute_logprobs(groups)

    def set_algorithm(self, algorithm: Any) -> None:
        """Keep the algorithm here, so one with state keeps it across steps."""
        self.algorithm = algorithm

    def train_step(self, groups: list[Any]) -> tuple[dict[str, float], int, list[list[Any]]]:
        """One step with the kept algorithm: (metrics, new weight version, what the trainer
        set on its copies of the samples: each sample's ``(trainer_logprobs,
        trainer_expert_agreement)``, by group)."""
        if self.algorithm is None:
            raise RuntimeError("no algorithm was sent to the trainer's actor")
        metrics = self.trainer.train_step(groups, self.algorithm)
        per_sample = [
            [(s.trainer_logprobs, s.trainer_expert_agreement) for s in g.samples] for g in groups
        ]
        return metrics, int(self.trainer.weight_version), per_sample

    def export_weights(self, *adapter: str) -> Iterator[tuple[str, Any]]:
        """Stream (name, tensor) to the caller (a Ray streaming generator); ``adapter``: the
        adapter's name, for a trainer of several."""
        yield from self.trainer.export_weights(*adapter)

    def export_model(self, *adapter: str) -> Iterator[tuple[str, Any]]:
        """Stream the whole merged model (a trainer with an adapter) to the caller."""
        yield from self.trainer.export_model(*adapter)

    def save_adapter(self, path: str, *adapter: str) -> None:
        """Write the trainer's adapter in PEFT's format under ``path`` (on this node)."""
        self.trainer.save_adapter(path, *adapter)

    def send_weights(
        self,
        version: int,
        engines: list[str],
        adapter: Any = None,
        args: tuple[Any, ...] = (),
    ) -> dict[str, float]:
        """Send the trainer's weights (an adapter's alone, with ``adapter``; ``args``: what
        names it to a trainer of several) through the sender to the engines at ``engines``,
        from this process."""
        extra = {} if adapter is None else {"adapter": adapter}
        metrics: dict[str, float] = self.sender.send(
            self.trainer.export_weights(*args), version=version, engines=engines, **extra
        )
        return metrics

    def send_tensors(
        self, weights: list[tuple[str, Any]], version: int, engines: list[str], adapter: Any = None
    ) -> dict[str, float]:
        """Send weights that came from elsewhere."""
        extra = {} if adapter is None else {"adapter": adapter}
        metrics: dict[str, float] = self.sender.send(
            weights, version=version, engines=engines, **extra
        )
        return metrics

    def save(self, path: str, extra: dict[str, Any] | None) -> None:
        """Save the trainer's state under ``path`` (on this actor's node)."""
        if extra is None:
            self.trainer.save(path)
        else:
            self.trainer.save(path, extra)

    def load(self, path: str) -> tuple[dict[str, Any], int]:
        """Restore a save; returns (its extra, the weight version)."""
        self.trainer.load(path)
        return dict(getattr(self.trainer, "extra", {}) or {}), int(self.trainer.weight_version)

    def sleep(self) -> None:
        """Free what the trainer can while the engines work."""
        self.trainer.sleep()

    def wake(self) -> None:
        """Bring back what :meth:`sleep` freed."""
        self.trainer.wake()

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Any other public method of the trainer backend (e.g. ``fingerprint``)."""
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self.trainer, method)(*args, **kwargs)

    def close_sender(self) -> None:
        """Close the sender (idempotent)."""
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def close(self) -> None:
        """Close the sender, then the trainer (idempotent)."""
        try:
            self.close_sender()
        finally:
            trainer, self.trainer = self.trainer, None
            if trainer is not None:
                trainer.close()
