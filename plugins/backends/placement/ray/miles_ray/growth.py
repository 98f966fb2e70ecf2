"""Engines for the nodes that join the cluster (the Ray placement's ``join_new_nodes``).

:class:`NodeWatch` remembers the cluster's nodes when the run was placed; asked at each step's
start (the ``miles_engines_to_add`` hook), it counts the nodes that have come up since it last
answered, and how many engines each holds: its resources over one engine's reservation (the
engine's own options: the embedded engine's ``ray_num_cpus`` / ``ray_num_gpus``). The run then
starts that many (``Membership.join``): each engine's actor reserves one engine's resources
wherever a node has room, which is where those nodes joined. A node is counted once; one that
goes and comes back is a new node to Ray (a new id), and counted again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from miles_core.errors import MilesUserError

Nodes = Callable[[], dict[str, Mapping[str, float]]]


def alive_nodes() -> dict[str, Mapping[str, float]]:
    """Every alive node of the connected Ray cluster: its id and its resources."""
    import ray

    return {n["NodeID"]: dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")}


class NodeWatch:
    """See the module docstring. ``engine``: one engine's reservation (resource -> amount);
    ``max_engines``: the job's engines at most (``None``: no limit); ``nodes``: the cluster's
    alive nodes (:func:`alive_nodes`), first read by :meth:`start`."""

    def __init__(
        self,
        engine: Mapping[str, float],
        max_engines: int | None,
        nodes: Nodes = alive_nodes,
    ) -> None:
        self.engine = {k: float(v) for k, v in engine.items() if v > 0}
        if not self.engine:
            raise MilesUserError(
                "plugins.options.ray.join_new_nodes: an engine that reserves no resource fits "
                "any node without end; give the engine a CPU or GPU reservation"
            )
        self.max_engines = max_engines
        self.nodes = nodes
        self.seen: set[str] = set()

    def start(self) -> NodeWatch:
        """Remember the nodes there are now (once the run is placed): none of them is new."""
        self.seen = set(self.nodes())
        return self

    def fits(self, resources: Mapping[str, Any]) -> int:
        """How many engines a node with ``resources`` holds."""
        return min(int(float(resources.get(k, 0.0)) // v) for k, v in self.engine.items())

    def engines_to_add(self, engines: int) -> int:
        """The engines the nodes that came up since the last call hold (at most
        ``max_engines`` less ``engines``, the job's engines now)."""
        alive = self.nodes()
        new = {node: res for node, res in alive.items() if node not in self.seen}
        self.seen.update(new)
        count = sum(self.fits(res) for res in new.values())
        if self.max_engines is not None:
            count = min(count, max(0, self.max_engines - engines))
        return count
