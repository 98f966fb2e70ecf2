"""A run's placement on Ray: the cluster connection, one placement group, the trainer's ranks
(one actor each, for a backend that declares ``placed_ranks``; else one actor holding the whole
trainer) and the bundle of every engine.

Start-up order: plan the bundles (no Ray yet) → join or start the cluster → refuse a layout
the cluster's nodes cannot hold, naming what is free → reserve the placement group (refused
the same way if it cannot be held in ``ready_timeout_s``) → build the trainer (its ranks start
in their bundles at the trainer's ``setup``) → tell the engine launcher the bundle of each
engine. Any failure releases what was taken, in reverse order. :meth:`RayPlacement.release`
(called by closing the trainer) does the same at the end of a run.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from miles_core.components import Kind, TrainerBackend
from miles_core.errors import MilesUserError
from miles_core.hosts import NODE_ADDRESS_ENV, forwarded_env
from miles_ray.layout import Layout, plan
from miles_ray.options import RayOptions
from miles_ray.proxy import RemoteSender, RemoteTrainer
from miles_ray.ranks import RankSender, RayRanks
from miles_ray.shm import remove_actor_memory

if TYPE_CHECKING:
    from miles_core.config import RunConfig


@runtime_checkable
class RayPlacedLauncher(Protocol):
    """An engine launcher that starts each engine server from a Ray actor and lets a placement
    choose the actor's bundle (the embedded engine with ``launch_in: ray_actor`` is one)."""

    num_engines: int
    #: the URL of each running engine, by its index
    urls: dict[int, str]

    def engine_resources(self) -> dict[str, float]:
        """What one engine's actor reserves, as Ray resources (``CPU``, ``GPU``...)."""
        ...

    def place_engines(
        self,
        actor_options: Callable[[int], dict[str, Any]],
        placement_timeout_s: float | None = None,
    ) -> None:
        """Start engine ``i``'s actor with the extra ``ray.remote`` options
        ``actor_options(i)`` (resources and scheduling strategy); an actor Ray has not placed
        within ``placement_timeout_s`` fails its engine's start."""
        ...

    def where(self, index: int) -> dict[str, Any]:
        """Engine ``index``'s actor: its pid, node address, placement group."""
        ...


def _options_data(options: Any) -> Any:
    return options.model_dump(mode="json") if isinstance(options, BaseModel) else None


def _component_spec(config: RunConfig) -> dict[str, Any]:
    """The run's trainer, transport and plugin lists as plain data, for another process."""
    return {
        "backend": [config.backend.name, _options_data(config.backend.options)],
        "transport": [config.transport.name, _options_data(config.transport.options)],
        "adapters": [[a.name, _options_data(a.options)] for a in config.adapter_selections()],
        "routing": config.rollout.routing,
        "true_on_policy": config.rollout.true_on_policy,
        "allow": list(config.plugins.allow),
        "block": list(config.plugins.block),
    }


def _make_sender(spec: dict[str, Any]) -> Any:
    """The run's weight sender, built in a rank's process with the run's plugins."""
    from miles_core.plugins import load_plugins
    from miles_ray.host import build_component

    plugins = load_plugins(allow=spec.get("allow") or None, block=spec.get("block") or None)
    return build_component(plugins.registry, Kind.TRANSPORT, *spec["transport"])


def check_fits(layout: Layout) -> None:
    """Refuse, before anything is reserved, a layout whose bundles the cluster's nodes cannot
    hold even when idle: each bundle must fit one alive node, and STRICT_SPREAD needs as many
    nodes as bundles. The message names the nodes and what each has."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    capacity = [
        (n.get("NodeManagerAddress", "?"), {k: float(v) for k, v in n["Resources"].items()})
        for n in nodes
    ]
    shown = ", ".join(
        f"{addr}: {{CPU: {res.get('CPU', 0):g}, GPU: {res.get('GPU', 0):g}}}"
        for addr, res in capacity
    )
    problems = []
    if layout.strategy == "STRICT_SPREAD" and len(layout.bundles) > len(capacity):
        problems.append(
            f"STRICT_SPREAD puts each of its {len(layout.bundles)} bundles on its own node, "
            f"and the cluster has {len(capacity)}"
        )
    for i, bundle in enumerate(layout.bundles):
        if not any(all(res.get(k, 0.0) >= v for k, v in bundle.items()) for _, res in capacity):
            problems.append(f"bundle {i} {bundle} fits no node")
    if problems:
        raise MilesUserError(
            f"run.placement {layout.placement!r} on Ray: {'; '.join(problems)}. The nodes: "
            f"{shown}. Use fewer trainer ranks (backend world_size) or engines (engine "
            "num_engines), reserve less each (MILES_RAY.trainer_cpus / trainer_gpus, the "
            "engine's Ray CPUs/GPUs), lower MILES_RAY.nodes, or add nodes"
        )


class RankLauncher:
    """Starts a trainer's ranks as actors in the placement's rank bundles (the controller's
    ``ranks=``), with a weight sender in each rank that feeds engines; closing it releases the
    whole placement."""

    def __init__(self, placement: RayPlacement, make_sender: Callable[[], Any]) -> None:
        self.placement = placement
        self.make_sender = make_sender

    def __call__(self, spec: Any, server: type) -> RayRanks:
        """Start ``spec.world_size`` rank actors of class ``server``."""
        p = self.placement
        if spec.world_size != len(p.layout.rank_bundles):
            raise MilesUserError(
                f"the placement was planned for {len(p.layout.rank_bundles)} trainer rank(s); "
                f"the trainer has world_size {spec.world_size}"
            )
        ranks = RayRanks(spec, server, p.rank_actor_options)
        try:
            ranks.attach_senders(self.make_sender, set(p.layout.feeders))
        except BaseException:
            ranks.close(graceful=False)
            raise
        p.ranks = ranks
        p.trainer_processes.extend(ranks.where)
        return ranks

    def close(self) -> None:
        """Release the placement (idempotent)."""
        self.placement.release()


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_cpus": resources.get("CPU", 0.0),
        "num_gpus": resources.get("GPU", 0.0),
    }
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        out["resources"] = custom
    return out


def _joining_options(layout: Layout, index: int) -> dict[str, Any]:
    """The ``ray.remote`` options of an engine beyond the planned ones: one engine's
    resources, with no bundle and no placement group (Ray puts it on any node with room);
    refused for a colocated run."""
    if index < 0:
        raise MilesUserError(f"engine index {index} is not allowed (0 or more)")
    if layout.placement != "disaggregated":
        raise MilesUserError(
            f"engine {index} cannot join a run.placement {layout.placement!r} run: a colocated "
            f"engine shares a trainer rank's devices, and the run's {len(layout.engine_bundles)} "
            "engine(s) (engine num_engines) are all it has; engines join only a "
            "'disaggregated' run"
        )
    return {**_actor_options(layout.engine), "scheduling_strategy": "DEFAULT"}


class RayPlacement:
    """What a run holds on Ray; see the module docstring."""

    def __init__(self, layout: Layout, options: RayOptions) -> None:
        self.layout = layout
        self.options = options
        self.pg: Any = None
        self.actor: Any = None
        self.trainer: Any = None
        self.transport: Any = None
        self.ranks: RayRanks | None = None
        #: ``where`` of every trainer actor (pid, node): see :mod:`miles_ray.shm`
        self.trainer_processes: list[dict[str, Any]] = []
        self.started_ray = False
        self.released = False
        self.launcher: Any = None
        self._driver_address: str | None = None
        self._set_address = False
        #: called once when the placement is released
        self.on_release: Callable[[], Any] | None = None

    # --- start ------------------------------------------------------------------------------

    @classmethod
    def start(
        cls, config: RunConfig, options: RayOptions, launcher: RayPlacedLauncher
    ) -> RayPlacement:
        """Place the run's trainer (and its senders) and engines; see the module docstring."""
        from miles_core.plugins import load_plugins

        registry = load_plugins(
            allow=list(config.plugins.allow) or None, block=list(config.plugins.block) or None
        ).registry
        record = registry.get(Kind.TRAINER_BACKEND, config.backend.name)
        placed = isinstance(record, TrainerBackend) and record.placed_ranks
        # a backend that declares placed_ranks has a world_size option (miles_core's record)
        world = int(config.backend.options.world_size) if placed else 1
        layout = plan(
            config.run.placement,
            {"CPU": options.trainer_cpus, "GPU": options.trainer_gpus},
            launcher.engine_resources(),
            launcher.num_engines,
            world_size=world,
            nodes=options.nodes,
            strategy=options.strategy,
        )
        self = cls(layout, options)
        try:
            self._connect()
            check_fits(layout)
            self._reserve(config.run.name)
            if placed:
                self._build_trainer(config, registry, launcher)
            else:
                self._start_trainer(config)
            launcher.place_engines(self.engine_actor_options, options.placement_timeout_s)
            self.launcher = launcher
        except BaseException:
            self.release()
            raise
        return self

    def _build_trainer(self, config: RunConfig, registry: Any, launcher: Any) -> None:
        """The backend's controller here, its ranks launched as actors at its ``setup``, and
        the run's senders in the ranks that feed engines."""
        from miles_core.registry import build_trainer
        from miles_ray.host import validated

        spec = _component_spec(config)
        adapters = [
            (name, validated(registry, Kind.ADAPTER, name, o)) for name, o in spec["adapters"]
        ]
        self.trainer = build_trainer(
            registry,
            config.backend.name,
            config.backend.options,
            adapters,
            routing=config.rollout.routing,
            true_on_policy=config.rollout.true_on_policy,
            ranks=RankLauncher(self, functools.partial(_make_sender, spec)),
        )

        def feeder(url: str) -> int:
            for index, engine_url in launcher.urls.items():
                if engine_url == url:
                    return self.feeder(index)
            raise ValueError(f"no engine of this run is at {url!r}")

        self.transport = RankSender(self._running_ranks, feeder)

    def _running_ranks(self) -> RayRanks:
        if self.ranks is None:
            raise RuntimeError("the trainer's ranks have not started: call setup() first")
        return self.ranks

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
                for k, v in (
                    ("num_cpus", o.num_cpus),
                    ("num_gpus", o.num_gpus),
                    ("object_store_mb", o.object_store_mb),
                )
                if v is not None
            ]
            if local_only:
                raise MilesUserError(
                    f"{', '.join(local_only)} size a local Ray cluster, but the run joins the "
                    f"cluster at {address!r}, which has its own; remove them"
                )
            if o.node_address is not None:
                common["_node_ip_address"] = o.node_address
            ray.init(address=address, **common)
            # This process is on the cluster's node now: the servers it starts (the router,
            # the session server) bind and advertise that node's address.
            self._driver_address = os.environ.get(NODE_ADDRESS_ENV)
            self._set_address = True
            os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()
        else:
            store = o.object_store_mb * (1 << 20) if o.object_store_mb is not None else None
            # A cluster the run starts for itself serves this machine alone: on loopback unless
            # MILES_RAY.node_address says otherwise (Ray turns 127.0.0.1 into the machine's
            # routable address; another loopback address it keeps).
            ray.init(
                num_cpus=o.num_cpus,
                num_gpus=o.num_gpus,
                object_store_memory=store,
                _node_ip_address=o.node_address or "127.0.1.1",
                **common,
            )
        self.started_ray = True

    def _reserve(self, run_name: str) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        self.pg = placement_group(
            self.layout.bundles,
            strategy=self.layout.strategy,
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
                f"bundles {self.layout.bundles} (strategy {self.layout.strategy}) within "
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

        spec = _component_spec(config)
        self.actor = (
            ray.remote(TrainerHost)
            .options(
                **_actor_options(self.layout.rank),
                scheduling_strategy=self._scheduling(self.layout.trainer_bundle),
                max_restarts=0,
            )
            .remote(spec, forwarded_env())
        )
        try:
            # the actor answers once the trainer and the sender are built
            where = ray.get(self.actor.where.remote(), timeout=self.options.actor_timeout_s)
            self.trainer_processes.append(where)
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

    def record(self) -> list[dict[str, Any]]:
        """Where each trainer rank (or the trainer's one actor) and each engine's actor is:
        role, index, bundle, node address, pid."""
        out: list[dict[str, Any]] = []
        if self.ranks is not None:
            for r, where in enumerate(self.ranks.where):
                bundle = self.layout.rank_bundles[r]
                out.append({"role": "trainer_rank", "index": r, "bundle": bundle, **where})
        elif self.trainer is not None and self.actor is not None:
            out.append({"role": "trainer", "index": 0, "bundle": 0, **self.trainer.where()})
        if self.launcher is not None:
            for i in sorted(self.launcher.urls):
                where = self.launcher.where(i)
                planned = i < len(self.layout.engine_bundles)
                engine_bundle = self.layout.engine_bundles[i] if planned else None  # joined
                feeder = self.feeder(i)
                out.append(
                    {"role": "engine", "index": i, "bundle": engine_bundle, "fed_by": feeder}
                    | where
                )
        return out

    def feeder(self, index: int) -> int:
        """The trainer rank that sends engine ``index`` its weights: the layout's for a
        planned engine, rank 0 for one that joined the run (only a disaggregated run takes
        joins, and there rank 0 feeds every engine)."""
        if 0 <= index < len(self.layout.feeders):
            return self.layout.feeders[index]
        return 0

    def rank_actor_options(self, rank: int) -> dict[str, Any]:
        """The ``ray.remote`` options of trainer rank ``rank``'s actor: its resources and
        bundle."""
        return {
            **_actor_options(self.layout.rank),
            "scheduling_strategy": self._scheduling(self.layout.rank_bundles[rank]),
        }

    def engine_actor_options(self, index: int) -> dict[str, Any]:
        """The ``ray.remote`` options of engine ``index``'s actor: its resources and bundle.
        An engine beyond the planned ones (joining a running job) has no bundle: in a
        disaggregated run its actor reserves one engine's resources wherever a node has
        them (a node that joined the cluster); a colocated run takes no joins."""
        if index < 0 or index >= len(self.layout.engine_bundles):
            return _joining_options(self.layout, index)
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
        if self.on_release is not None:
            self.on_release()
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            if self.ranks is not None:
                ranks, self.ranks = self.ranks, None
                ranks.close()
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
                released, self.trainer_processes = self.trainer_processes, []
                remove_actor_memory(released, self.options.shm_cleanup_timeout_s)
                if self.started_ray:
                    ray.shutdown()
                    self.started_ray = False
                if self._set_address:
                    self._set_address = False
                    os.environ.pop(NODE_ADDRESS_ENV, None)
                    if self._driver_address is not None:
                        os.environ[NODE_ADDRESS_ENV] = self._driver_address
