"""Weight updates of the engine fleet: the trainer's weights sent through the run's transport
to every serving and every restarted engine, generation paused around the update when the
schedule asks, and an update retried on the others when an engine dies during it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from miles_core.contracts import AdapterSync, WeightTransport
from miles_core.runtime.routes import Engine

if TYPE_CHECKING:
    from miles_core.runtime.fleet import EngineFleet

#: the trainer's weights, streamed while the block runs (``weights(name)``: an adapter's)
Weights = Callable[..., AbstractContextManager[Iterable[tuple[str, Any]]]]


def send_weights(
    transport: WeightTransport,
    weights: Weights,
    version: int,
    urls: list[str],
    adapters: Sequence[AdapterSync],
) -> dict[str, float]:
    """Send the trainer's ``weights()`` as ``version`` to the engines at ``urls``; with
    ``adapters``, each adapter alone (``weights(name)`` of several: its tensors), the engines
    keeping the base, and the numbers the transport reports summed over them."""
    if not adapters:
        with weights() as tensors:
            return transport.send(tensors, version=version, engines=urls)
    total: dict[str, float] = {}
    for adapter in adapters:
        with weights(adapter.name) if len(adapters) > 1 else weights() as tensors:
            sent = transport.send(tensors, version=version, engines=urls, adapter=adapter)
        for key, value in sent.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0.0) + float(value)
    return total


class PublishError(RuntimeError):
    """A weight update failed; the engines stay on their previous version."""


class WeightPublisher:
    """The fleet's weight updates (see the module docstring); one at a time."""

    def __init__(
        self,
        fleet: EngineFleet,
        transport: WeightTransport | None,
        weights: Weights | None,
        adapters: Sequence[AdapterSync],
    ) -> None:
        self.fleet = fleet
        self.transport = transport
        self.weights = weights
        self.adapters = list(adapters)
        self._update = asyncio.Lock()

    @property
    def between_updates(self) -> asyncio.Lock:
        """The lock every update holds: a block under it runs between two updates, so the
        weights the engines serve do not change meanwhile."""
        return self._update

    async def publish(
        self, version: int, *, pause: str | None = None, only_restarted: bool = False
    ) -> dict[str, float]:
        """See :meth:`EngineFleet.publish`."""
        if self.transport is None or self.weights is None:
            raise PublishError("these engines serve fixed weights: nothing is published to them")
        fleet = self.fleet
        async with self._update:
            fleet.version = version
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            for _ in range(1 + len(fleet.engines)):
                targets = [
                    e for e in fleet.engines if e.restarted or not (e.down or only_restarted)
                ]
                if not targets:
                    break
                restarts = [e.restarts for e in targets]
                try:
                    metrics = await self._update_engines(targets, pause)
                    break
                except PublishError:
                    if not await self._lost_during_update(targets, restarts):
                        raise
            else:
                raise PublishError(f"weight update to version {version}: engines kept dying")
            metrics["time/sync_s"] = time.perf_counter() - t0
            return metrics

    async def _lost_during_update(self, targets: list[Engine], restarts: list[int]) -> bool:
        """After a failed update: restart the targets that died (a restarted one that died
        again included); whether any target was lost, so that the update is worth retrying
        on the others. An engine that the rollout side found dead and restarted while the
        update was failing counts too (``restarts``: each target's count when it began),
        even when it is already back and answering."""
        # A probe speaks of the server it reached: a restart that brought a new server up
        # meanwhile (a new client) is not the dead one's, and is not restarted again.
        probed = [e.client for e in targets]
        states = await asyncio.gather(*(self.fleet.alive(e) for e in targets))
        dead = [
            e
            for e, ok, client in zip(targets, states, probed, strict=True)
            if not ok and e.client is client
        ]
        for engine in dead:
            if not engine.down or engine.restarted:  # not restarting already
                self.fleet.begin_restart(engine)
        restarted = any(e.restarts != n for e, n in zip(targets, restarts, strict=True))
        return bool(dead) or restarted or any(e.down and not e.restarted for e in targets)

    async def _update_engines(self, targets: list[Engine], pause: str | None) -> dict[str, float]:
        fleet = self.fleet
        live = [e for e in targets if not e.down] if pause else []
        paused = await asyncio.gather(
            *(e.client.pause_generation(pause) for e in live if pause), return_exceptions=True
        )
        try:
            failed = [(e, a) for e, a in zip(live, paused, strict=True) if isinstance(a, Exception)]
            if failed:
                raise PublishError(
                    f"engine(s) {[e.index for e, _ in failed]} did not pause: {failed[0][1]!r}"
                )
            metrics = await self._send(targets)
            back = [e for e in targets if e.restarted]
            for engine in targets:
                engine.version = fleet.version
                if engine.restarted:  # now it has the weights: it serves
                    engine.down = engine.restarted = False
            if back:  # it serves again, through the router too
                await fleet.router_serves()
            return metrics
        finally:
            answers = await asyncio.gather(
                *(e.client.continue_generation() for e in live), return_exceptions=True
            )
            for engine, answer in zip(live, answers, strict=True):
                if isinstance(answer, BaseException):
                    fleet.log(f"engine {engine.index}: continue_generation failed: {answer!r}")
                    await fleet.find_dead([engine])

    async def _send(self, targets: list[Engine]) -> dict[str, float]:
        result: dict[str, Any] = {}
        version, urls = self.fleet.version, self.fleet.urls(targets)
        try:
            result = await asyncio.to_thread(self._send_blocking, version, urls)
        except Exception as exc:
            # What an engine keeps after a failed update is the transport's to say (its README):
            # the embedded engine stays on its previous weights and version.
            raise PublishError(f"weight update to version {version} failed: {exc}") from exc
        return {
            k if k.startswith("sync/") else f"sync/{k}": float(v)
            for k, v in result.items()
            if isinstance(v, (int, float))
        }

    def _send_blocking(self, version: int, urls: list[str]) -> dict[str, float]:
        assert self.transport is not None and self.weights is not None
        return send_weights(self.transport, self.weights, version, urls, self.adapters)
