"""Which placement-group bundles a run asks Ray for, and which bundle each actor takes.

Pure arithmetic (no Ray import), so the layout is checked before a cluster is touched:

* ``colocated`` over ``nodes`` nodes: one bundle a node, holding ``world_size / nodes``
  trainer ranks and ``num_engines / nodes`` engines; its size is the sum of what they
  reserve. Actors in one bundle share its node, and a fractional GPU request
  (``trainer_gpus: 0.5`` and an engine's ``0.5``) gives them the same device. Each engine is fed
  by the first rank of its bundle: weights never cross a node through shared memory.
* ``disaggregated``: a bundle per trainer rank, then a bundle per engine; rank 0 feeds every
  engine (broadcast or p2p).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from miles_core.errors import MilesUserError

Resources = Mapping[str, float]


def _clean(resources: Resources) -> dict[str, float]:
    # Ray refuses zero-valued bundle entries; an absent key means none.
    return {k: float(v) for k, v in resources.items() if v}


def _sum(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for res in parts:
        for k, v in res.items():
            out[k] = out.get(k, 0.0) + v
    return out


@dataclass(frozen=True)
class Layout:
    """The bundles of the run's placement group, who sits in which, and who feeds whom."""

    placement: str
    bundles: list[dict[str, float]]
    #: the bundle of each trainer rank
    rank_bundles: list[int]
    #: the bundle of each engine
    engine_bundles: list[int]
    #: what one trainer rank reserves
    rank: dict[str, float]
    #: what one engine reserves
    engine: dict[str, float]
    #: the rank that sends each engine its weights
    feeders: list[int]
    #: the placement-group strategy
    strategy: str

    @property
    def trainer_bundle(self) -> int:
        """Rank 0's bundle."""
        return self.rank_bundles[0]


def _colocated(
    t: dict[str, float], e: dict[str, float], num_engines: int, world_size: int, nodes: int
) -> tuple[list[dict[str, float]], list[int], list[int], list[int]]:
    if world_size % nodes or num_engines % nodes:
        raise MilesUserError(
            f"run.placement 'colocated' over MILES_RAY.nodes={nodes} nodes: each node holds the "
            f"same share of the {world_size} trainer rank(s) (backend world_size) and of the "
            f"{num_engines} engine(s) (engine num_engines); make both multiples of {nodes}"
        )
    per_rank, per_engine = world_size // nodes, num_engines // nodes
    bundle = _sum([t] * per_rank + [e] * per_engine)
    if not bundle:
        raise MilesUserError(
            "run.placement 'colocated' on Ray: the trainer and the engines reserve no CPU and "
            "no GPU, so their shared bundle would be empty; give MILES_RAY.trainer_cpus or "
            "the engine's Ray CPUs a positive value"
        )
    ranks = [r // per_rank for r in range(world_size)]
    engines = [i // per_engine for i in range(num_engines)]
    feeders = [b * per_rank for b in engines]
    return [dict(bundle) for _ in range(nodes)], ranks, engines, feeders


def plan(
    placement: str,
    rank: Resources,
    engine: Resources,
    num_engines: int,
    *,
    world_size: int = 1,
    nodes: int = 1,
    strategy: str | None = None,
) -> Layout:
    """The layout of ``world_size`` trainer ranks (each reserving ``rank``) and
    ``num_engines`` engines (each reserving ``engine``) for ``placement`` (``colocated`` or
    ``disaggregated``); ``strategy``: the placement group's (default in the module's
    options)."""
    if num_engines < 1:
        raise MilesUserError(f"a Ray placement needs at least one engine (got {num_engines})")
    t, e = _clean(rank), _clean(engine)
    if placement == "colocated":
        bundles, ranks, engines, feeders = _colocated(t, e, num_engines, world_size, nodes)
        chosen = strategy or ("STRICT_SPREAD" if nodes > 1 else "PACK")
        return Layout(placement, bundles, ranks, engines, t, e, feeders, chosen)
    if placement == "disaggregated":
        if not t:
            raise MilesUserError(
                "run.placement 'disaggregated' on Ray: each trainer rank reserves no CPU and "
                "no GPU, so its bundle would be empty; set MILES_RAY.trainer_cpus or "
                "trainer_gpus > 0"
            )
        if not e:
            raise MilesUserError(
                "run.placement 'disaggregated' on Ray: each engine reserves no CPU and no GPU, "
                "so its bundle would be empty; give the engine's Ray CPUs or GPUs a positive "
                "value (embedded engine: ray_num_cpus / ray_num_gpus)"
            )
        bundles = [dict(t) for _ in range(world_size)] + [dict(e) for _ in range(num_engines)]
        engines = list(range(world_size, world_size + num_engines))
        return Layout(
            placement,
            bundles,
            list(range(world_size)),
            engines,
            t,
            e,
            [0] * num_engines,
            strategy or "PACK",
        )
    raise MilesUserError(f"unknown run.placement {placement!r}; allowed: colocated, disaggregated")
