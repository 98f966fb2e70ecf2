"""Which placement-group bundles a run asks Ray for, and which bundle each actor takes.

Pure arithmetic (no Ray import), so the layout is checked before a cluster is touched:

* ``colocated``: one bundle holds the trainer and every engine; its size is the sum of what
  they reserve. Actors in one bundle share its node, and a fractional GPU request
  (``trainer_gpus: 0.5`` and an engine's ``0.5``) gives them the same device.
* ``disaggregated``: bundle 0 is the trainer's, bundle ``1 + i`` engine ``i``'s: separate pools.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from miles_core.errors import MilesUserError

Resources = Mapping[str, float]


def _clean(resources: Resources) -> dict[str, float]:
    # Ray refuses zero-valued bundle entries; an absent key means none.
    return {k: float(v) for k, v in resources.items() if v}


@dataclass(frozen=True)
class Layout:
    """The bundles of the run's placement group and who sits in which."""

    placement: str
    bundles: list[dict[str, float]]
    trainer_bundle: int
    engine_bundles: list[int]
    trainer: dict[str, float]
    engine: dict[str, float]


def plan(placement: str, trainer: Resources, engine: Resources, num_engines: int) -> Layout:
    """The layout of ``num_engines`` engines (each reserving ``engine``) and one trainer
    (reserving ``trainer``) for ``placement`` (``colocated`` or ``disaggregated``)."""
    if num_engines < 1:
        raise MilesUserError(f"a Ray placement needs at least one engine (got {num_engines})")
    t, e = _clean(trainer), _clean(engine)
    if placement == "colocated":
        shared: dict[str, float] = {}
        for res in (t, *([e] * num_engines)):
            for k, v in res.items():
                shared[k] = shared.get(k, 0.0) + v
        if not shared:
            raise MilesUserError(
                "run.placement 'colocated' on Ray: the trainer and the engines reserve no CPU and "
                "no GPU, so their shared bundle would be empty; give MILES_RAY.trainer_cpus or "
                "the engine's Ray CPUs a positive value"
            )
        return Layout(placement, [shared], 0, [0] * num_engines, t, e)
    if placement == "disaggregated":
        if not t:
            raise MilesUserError(
                "run.placement 'disaggregated' on Ray: the trainer reserves no CPU and no GPU, "
                "so its bundle would be empty; set MILES_RAY.trainer_cpus or trainer_gpus > 0"
            )
        if not e:
            raise MilesUserError(
                "run.placement 'disaggregated' on Ray: each engine reserves no CPU and no GPU, "
                "so its bundle would be empty; give the engine's Ray CPUs or GPUs a positive "
                "value (embedded engine: ray_num_cpus / ray_num_gpus)"
            )
        bundles = [dict(t)] + [dict(e) for _ in range(num_engines)]
        return Layout(placement, bundles, 0, list(range(1, num_engines + 1)), t, e)
    raise MilesUserError(f"unknown run.placement {placement!r}; allowed: colocated, disaggregated")
