"""A trainer's ranks as Ray actors, one per rank, each in its own bundle of the run's placement
group (so on any node), and the weight sender that feeds the engines from them.

:class:`RayRanks` is what a trainer backend's controller drives (the ``Ranks`` of
``miles_trainer_common``): every call reaches every rank's actor; the first error or death
stops them all and is raised with the rank's traceback. The ranks meet over TCP at rank 0's
node address. Every actor knows its node's address (``MILES_NODE_ADDRESS``), which its servers
and rendezvous bind.

A weight sync stays with the ranks: :meth:`RayRanks.export` returns a :class:`RankWeights`
handle, and :class:`RankSender` given that handle asks every rank to export at once, each rank
that feeds engines sending to its own (rank 0's tensors relayed to the others through the
trainer's group). Iterated anywhere else, the handle streams rank 0's tensors through Ray.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from miles_core.hosts import NODE_ADDRESS_ENV, forwarded_env


class RankError(RuntimeError):
    """A rank's actor failed or died; every rank of the trainer has been stopped."""


class SendError(RuntimeError):
    """A rank's weight sender failed (an engine died, refused the update...); the ranks stay
    in step and usable: the update can be sent again."""


def on_node(cls: type) -> type:
    """``cls`` whose instances first set ``MILES_NODE_ADDRESS`` to the address of the node Ray
    put them on (and ``MILES_API_KEY`` to the driver's, when it has one)."""

    class OnNode(cls):  # type: ignore[misc, valid-type]
        def __init__(self, env: dict[str, str], *args: Any, **kwargs: Any) -> None:
            import ray

            os.environ.update(env)
            os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()
            super().__init__(*args, **kwargs)

        def where(self) -> dict[str, Any]:
            """The class's own ``where``, with the Ray node and placement group."""
            import ray

            ctx = ray.get_runtime_context()
            found: dict[str, Any] = super().where()
            found.update(node_id=ctx.get_node_id(), placement_group_id=ctx.get_placement_group_id())
            return found

    OnNode.__name__ = OnNode.__qualname__ = cls.__name__
    return OnNode


class RayRanks:
    """``spec.world_size`` rank actors (class ``server``), rank ``r`` started with the extra
    ``ray.remote`` options ``actor_options(r)`` (its resources and bundle). Blocks until each
    rank joined the group (``spec.timeout_s``)."""

    def __init__(
        self, spec: Any, server: type, actor_options: Callable[[int], dict[str, Any]]
    ) -> None:
        import ray

        self.spec = spec
        self.name = spec.name
        self.world_size: int = spec.world_size
        self._exporting = False
        remote: Any = ray.remote(on_node(server))
        self.actors = [
            remote.options(**actor_options(r), max_restarts=0).remote(forwarded_env())
            for r in range(self.world_size)
        ]
        try:
            self.where: list[dict[str, Any]] = self._gather(
                [a.where.remote() for a in self.actors], "start"
            )
            rendezvous = self._gather([self.actors[0].rendezvous.remote()], "start")[0]
            self._gather(
                [a.start.remote(spec, r, rendezvous) for r, a in enumerate(self.actors)], "start"
            )
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def closed(self) -> bool:
        """True once the ranks were stopped."""
        return not self.actors

    def _fail(self, message: str) -> RankError:
        self.close(graceful=False)
        return RankError(message)

    def _gather(
        self,
        refs: list[Any],
        what: str,
        ranks: Sequence[int] | None = None,
        *,
        in_step: bool = False,
    ) -> list[Any]:
        """The values of ``refs`` (one per rank of ``ranks``, all by default); the first error
        or death among them stops every rank and is raised at once. ``in_step``: an error a
        rank raised leaves the ranks in step (a weight sender's: every rank finished its part
        of the export), so the others are awaited and it is raised as :class:`SendError`, the
        ranks kept; a death still stops them all."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.closed:
            raise RankError(f"the {self.name} rank actors were stopped")
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        rank_of = {ref: r for ref, r in zip(refs, ranks, strict=True)}
        values: dict[Any, Any] = {}
        failed: list[str] = []
        deadline = time.monotonic() + self.spec.timeout_s
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(rank_of[r] for r in pending)
                raise self._fail(f"{self.name} ranks {late} did not answer {what} in time")
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for ref in done:
                rank = rank_of[ref]
                try:
                    values[ref] = ray.get(ref)
                except RayTaskError as exc:
                    message = f"{self.name} rank {rank} failed in {what}:\n{exc}"
                    if not in_step:
                        raise self._fail(message) from None
                    failed.append(message)
                except RayActorError as exc:
                    raise self._fail(f"{self.name} rank {rank} died in {what}: {exc}") from None
        if failed:
            raise SendError("\n".join(failed))
        return [values[ref] for ref in refs]

    def _check_idle(self) -> None:
        if self.closed:
            raise RankError(f"the {self.name} rank actors were stopped")
        if self._exporting:
            raise RuntimeError(
                "an export_weights() iterator is still open: exhaust or close() it first"
            )

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; the answers in rank order."""
        self._check_idle()
        return self._gather([a.call.remote(method, args, kwargs) for a in self.actors], method)

    def export(self, method: str = "export_tensors", **kwargs: Any) -> RankWeights:
        """A handle on the ranks' collective ``method`` (see the module docstring)."""
        self._check_idle()
        return RankWeights(self, method, kwargs)

    def attach_senders(self, make: Callable[[], Any], ranks: Iterable[int]) -> None:
        """Build a weight sender with ``make()`` in each rank of ``ranks``."""
        ranks = sorted(set(ranks))
        refs = [self.actors[r].attach_sender.remote(make) for r in ranks]
        self._gather(refs, "attach_sender", ranks)

    def send(
        self,
        weights: RankWeights,
        engines: dict[int, list[str]],
        version: int,
        adapter: Any = None,
    ) -> dict[str, float]:
        """Every rank exports ``weights``' method; rank ``r`` sends to ``engines[r]``. The
        metrics: each key's largest value among the ranks that sent."""
        self._check_idle()
        receivers = sorted(r for r, urls in engines.items() if urls)
        refs = [
            a.send.remote(
                weights.method, weights.kwargs, engines.get(r, []), receivers, version, adapter
            )
            for r, a in enumerate(self.actors)
        ]
        merged: dict[str, float] = {}
        for metrics in self._gather(refs, "send_weights", in_step=True):
            for key, value in metrics.items():
                merged[key] = max(merged.get(key, value), value)
        return merged

    def send_tensors(
        self, weights: list[tuple[str, Any]], engines: list[str], version: int, adapter: Any
    ) -> dict[str, float]:
        """Send tensors that came from elsewhere through rank 0's sender."""
        self._check_idle()
        ref = self.actors[0].send_tensors.remote(weights, engines, version, adapter)
        metrics: dict[str, float] = self._gather([ref], "send_weights", [0], in_step=True)[0]
        return metrics

    def close(self, graceful: bool = True) -> None:
        """Close every rank (its sender and group), then kill its actor (idempotent)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        actors, self.actors = self.actors, []
        if graceful and actors:
            try:
                ray.get([a.close.remote() for a in actors], timeout=60)
            except (RayActorError, GetTimeoutError):
                pass  # a dead or stuck rank: killing it is all that is left
        for actor in actors:
            ray.kill(actor)


class RankWeights:
    """The weights of the ranks' collective ``method``, not yet moved: iterated, rank 0
    streams them through Ray while every other rank takes part."""

    def __init__(self, ranks: RayRanks, method: str, kwargs: dict[str, Any]) -> None:
        self.ranks = ranks
        self.method = method
        self.kwargs = kwargs
        self._stream: Iterator[tuple[str, Any]] | None = None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self

    def __next__(self) -> tuple[str, Any]:
        if self._stream is None:
            self._stream = self._run()
        return next(self._stream)

    def _run(self) -> Iterator[tuple[str, Any]]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ranks = self.ranks
        ranks._check_idle()
        head, *rest = ranks.actors
        stream = head.export.options(num_returns="streaming").remote(self.method, self.kwargs)
        follow = [a.follow.remote(self.method, self.kwargs) for a in rest]
        ranks._exporting = True
        finished = False
        try:
            for ref in stream:
                name, tensor = ray.get(ref)
                yield name, tensor
            finished = True
        except (RayTaskError, RayActorError) as exc:
            ranks._exporting = False
            raise ranks._fail(f"{ranks.name} rank 0 failed in export_weights:\n{exc}") from None
        finally:
            if not ranks.closed:
                try:
                    if not finished:
                        # A consumer that stopped early: rank 0 still streams to the end
                        # (every rank takes part in each gather), then all are in step again.
                        for ref in stream:
                            ray.get(ref)
                finally:
                    ranks._exporting = False
                ranks._gather(follow, "export_weights", range(1, ranks.world_size))


class RankSender:
    """The run's weight transport on the driver's side, whose senders live in the rank
    actors: ``ranks()`` gives the running ranks (started by the trainer's ``setup``), and
    ``feeder(url)`` the rank that feeds the engine at ``url`` (one on its own node when
    colocated; rank 0 otherwise)."""

    def __init__(self, ranks: Callable[[], RayRanks], feeder: Callable[[str], int]) -> None:
        self.ranks = ranks
        self.feeder = feeder

    def send(
        self,
        weights: Iterable[tuple[str, Any]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: Any = None,
    ) -> dict[str, float]:
        """Send ``weights`` to ``engines``: the ranks' own (a :class:`RankWeights` of these
        ranks) from the ranks that feed each engine; any other through rank 0's sender."""
        ranks = self.ranks()
        if isinstance(weights, RankWeights) and weights.ranks is ranks:
            by_rank: dict[int, list[str]] = {}
            for url in engines:
                by_rank.setdefault(self.feeder(url), []).append(url)
            return ranks.send(weights, by_rank, version, adapter)
        return ranks.send_tensors(list(weights), list(engines), version, adapter)

    def close(self) -> None:
        """The senders close with their ranks."""
