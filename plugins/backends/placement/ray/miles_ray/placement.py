"""A run's placement on Ray: the cluster connection, one placement group, the trainer's actor,
and the bundle of every engine.

Start-up order: plan the bundles (no Ray yet) → join or start the cluster → reserve the
placement group (refused with the cluster's free resources if it cannot be held in
``ready_timeout_s``) → start the trainer's actor in its bundle → tell the engine launcher the
bundle of each engine. Any failure releases what was taken, in reverse order.
:meth:`RayPlacement.release` (called by closing the trainer) does the same at the end of a run.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from miles_core.errors import MilesUserError
from miles_ray.layout import Layout, plan
from miles_ray.options import RayOptions
from miles_ray.proxy import RemoteSender, RemoteTrainer

if TYPE_CHECKING:
    from collections.abc import Callable

    from miles_core.config import RunConfig


@runtime_checkable
class RayPlacedLauncher(Protocol):
    """An engine launcher that starts each engine server from a Ray actor and lets a placement
    choose the actor's bundle (the embedded engine with ``launch_in: ray_actor`` is one)."""

    num_engines: int

    def engine_resources(self) -> dict[str, float]:
        """What one engine's actor reserves, as Ray resources (``CPU``, ``GPU``...)."""
        ...

    def place_engines(self, actor_options: Callable[[int], dict[str, Any]]) -> None:
        """Start engine ``i``'s actor with the extra ``ray.remote`` options
        ``actor_options(i)`` (resources and scheduling strategy)."""
        ...


def _options_data(options: Any) -> Any:
    return options.model_dump(mode="json") if isinstance(options, BaseModel) else None


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_cpus": resources.get("CPU", 0.0),
        "num_gpus": resources.get("GPU", 0.0),
    }
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        out["resources"] = custom
    return out


class RayPlacement:
    """What a run holds on Ray; see the module docstring."""

    def __init__(self, layout: Layout, options: RayOptions) -> None:
        self.layout = layout
        self.options = options
        self.pg: Any = None
        self.actor: Any = None
        self.trainer: RemoteTrainer | None = None
        self.transport: RemoteSender | None = None
        self.started_ray = False
        self.released = False

    # --- start ------------------------------------------------------------------------------

    @classmethod
    def start(
        cls, config: RunConfig, options: RayOptions, launcher: RayPlacedLauncher
    ) -> RayPlacement:
        """Place the run's trainer (and its sender) and engines; see the module docstring."""
        num_engines = launcher.num_engines
        layout = plan(
            config.run.placement,
            {"CPU": options.trainer_cpus, "GPU": options.trainer_gpus},
            launcher.engine_resources(),
            num_engines,
        )
        self = cls(layout, options)
        try:
            self._connect()
            self._reserve(config.run.name)
            self._start_trainer(config)
            launcher.place_engines(self.engine_actor_options)
        except BaseException:
            self.release()
            raise
        return self

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's cluster: it also stops it
        o = self.options
        address = o.address or os.environ.get("RAY_ADDRESS") or None
        common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": o.log_to_driver}
        if address is not None:
            local_only = [
                f"MILES_RAY.{k}"
                for k in ("num_cpus", "num_gpus", "object_store_mb")
                if getattr(o, k) is not None
            ]
            if local_only:
                raise MilesUserError(
                    f"{', '.join(local_only)} size a local Ray cluster, but the run joins the "
                    f"cluster at {address!r}, which has its own; remove them"
                )
            ray.init(address=address, **common)
        else:
            store = o.object_store_mb * (1 << 20) if o.object_store_mb is not None else None
            ray.init(num_cpus=o.num_cpus, num_gpus=o.num_gpus, object_store_memory=store, **common)
        self.started_ray = True

    def _reserve(self, run_name: str) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        self.pg = placement_group(
            self.layout.bundles,
            strategy=self.options.strategy,
            name=f"miles-{run_name}-{uuid.uuid4().hex[:8]}",
        )
        try:
            ray.get(self.pg.ready(), timeout=self.options.ready_timeout_s)
        except GetTimeoutError:
            free = {
                k: v
                for k, v in sorted(ray.available_resources().items())
                if k in ("CPU", "GPU") or not ("_group_" in k or k.startswith(("node:", "bundle")))
            }
            raise MilesUserError(
                f"run.placement {self.layout.placement!r}: the Ray cluster could not reserve the "
                f"bundles {self.layout.bundles} (strategy {self.options.strategy}) within "
                f"{self.options.ready_timeout_s:g} s; it has {free} free. Lower what the trainer "
                "(MILES_RAY.trainer_cpus / trainer_gpus) or each engine reserves, use fewer "
                "engines, or give the cluster more resources (MILES_RAY.num_cpus for a local one)"
            ) from None

    def _scheduling(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle
        )

    def _start_trainer(self, config: RunConfig) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from miles_ray.host import TrainerHost

        spec = {
            "backend": [config.backend.name, _options_data(config.backend.options)],
            "transport": [config.transport.name, _options_data(config.transport.options)],
            "adapters": [[a.name, _options_data(a.options)] for a in config.adapter_selections()],
            "routing": config.rollout.routing,
            "true_on_policy": config.rollout.true_on_policy,
            "allow": list(config.plugins.allow),
            "block": list(config.plugins.block),
        }
        self.actor = (
            ray.remote(TrainerHost)
            .options(
                **_actor_options(self.layout.trainer),
                scheduling_strategy=self._scheduling(self.layout.trainer_bundle),
                max_restarts=0,
            )
            .remote(spec)
        )
        try:
            # the actor answers once the trainer and the sender are built
            ray.get(self.actor.where.remote(), timeout=self.options.actor_timeout_s)
        except RayActorError as exc:
            raise RuntimeError(
                f"the trainer's Ray actor failed to start ({config.backend.name} backend, "
                f"{config.transport.name} transport): {exc}"
            ) from exc
        except GetTimeoutError:
            raise RuntimeError(
                f"the trainer's Ray actor did not start within {self.options.actor_timeout_s:g} s"
            ) from None
        self.trainer = RemoteTrainer(self, self.actor)
        self.transport = RemoteSender(self.actor)

    def engine_actor_options(self, index: int) -> dict[str, Any]:
        """The ``ray.remote`` options of engine ``index``'s actor: its resources and bundle."""
        if not 0 <= index < len(self.layout.engine_bundles):
            raise MilesUserError(
                f"engine {index} has no bundle: the placement was planned for "
                f"{len(self.layout.engine_bundles)} engine(s) (engine num_engines)"
            )
        return {
            **_actor_options(self.layout.engine),
            "scheduling_strategy": self._scheduling(self.layout.engine_bundles[index]),
        }

    # --- end --------------------------------------------------------------------------------

    def release(self) -> None:
        """Close the trainer in its actor, kill the actor, remove the placement group (which
        stops any engine actor still in it) and stop a local cluster the run started.
        Idempotent; every step runs even if an earlier one failed."""
        if self.released:
            return
        self.released = True
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            if self.actor is not None:
                try:
                    ray.get(self.actor.close.remote(), timeout=120)
                except (RayActorError, GetTimeoutError):
                    pass  # dead or stuck: killing it below is all that is left
                finally:
                    ray.kill(self.actor)
                    self.actor = None
        finally:
            try:
                if self.pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self.pg)
                    self.pg = None
            finally:
                if self.started_ray:
                    ray.shutdown()
                    self.started_ray = False
