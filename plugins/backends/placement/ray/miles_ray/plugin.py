"""Registers the Ray placement with Miles (entry point ``ray`` in the group ``miles``).

Importing this module imports no Ray: the placement imports it when a run is placed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core import hookimpl
from miles_core.errors import ConfigError, MilesUserError

if TYPE_CHECKING:
    from miles_core.config import RunConfig


@hookimpl
def miles_configure(config: RunConfig) -> None:
    """Validate ``plugins.options.ray`` (or ``MILES_RAY``) before any work starts."""
    from miles_ray.options import SECTION, RayOptions

    options = RayOptions.from_config(config)
    if options.join_new_nodes and config.run.placement != "disaggregated":
        raise ConfigError(
            [
                f"join_new_nodes: a run.placement {config.run.placement!r} run takes no engines "
                "beyond its own (a colocated engine shares a trainer rank's devices); set it "
                "false, or place the run 'disaggregated'"
            ],
            source=SECTION,
        )


@hookimpl
def miles_place(config: RunConfig, launcher: Any) -> tuple[Any, Any, Any] | None:
    """Place the run on Ray when it is ``disaggregated``, or ``colocated`` with engines that
    start in Ray actors; otherwise leave it to the default (everything in this process)."""
    from miles_ray.placement import RayPlacedLauncher

    on_ray = isinstance(launcher, RayPlacedLauncher)
    if config.run.placement == "colocated" and not on_ray:
        return None
    if not on_ray:
        raise MilesUserError(
            f"run.placement {config.run.placement!r} places the engines in Ray actors, but "
            f"engine {config.engine.name!r} starts its servers as local processes, outside the "
            "placement group; choose an engine launched from Ray actors (the embedded engine: "
            "launch_in: ray_actor)"
        )
    from miles_ray.growth import NodeWatch
    from miles_ray.options import RayOptions
    from miles_ray.placement import RayPlacement

    options = RayOptions.from_config(config)
    watch = None  # built before anything is placed: a refusal holds nothing
    if options.join_new_nodes:
        watch = NodeWatch(launcher.engine_resources(), options.max_engines)
    placement = RayPlacement.start(config, options, launcher)
    PLACED[id(config)] = placement
    if watch is not None:
        WATCHES[id(config)] = watch.start()

    def released() -> None:
        PLACED.pop(id(config), None)
        WATCHES.pop(id(config), None)

    placement.on_release = released
    return placement.trainer, placement.transport, launcher


#: the placement of each run this process placed and has not released, by its config's id
PLACED: dict[int, Any] = {}
#: the node watch of each such run with ``join_new_nodes``, by its config's id
WATCHES: dict[int, Any] = {}


@hookimpl
def miles_placement_record(config: RunConfig) -> list[dict[str, Any]] | None:
    """Where this run's trainer ranks and engine actors are (``None``: not placed here)."""
    placement = PLACED.get(id(config))
    return None if placement is None else placement.record()


@hookimpl
def miles_engines_to_add(config: RunConfig, engines: int) -> int | None:
    """Engines for the nodes that joined the cluster (``join_new_nodes``; ``None``: not
    asked to watch, or not placed here)."""
    watch = WATCHES.get(id(config))
    return None if watch is None else int(watch.engines_to_add(engines))
