"""The engine fleet: the one place that launches the engines, probes their health, restarts a
dead one and gives it the current weights before it serves, routes generation, and publishes
weight updates through the run's transport. Both schedules use it; nothing else in the core
talks to an engine's control endpoints.

It lives on the run's event loop (the I/O thread). Routing: with more than one engine and a
router component (``sglang-router``), generation goes through the router and control calls go
to each engine directly; otherwise each engine is a route of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from miles_core.contracts import (
    AdapterSync,
    EngineClient,
    EngineLauncher,
    Router,
    WeightTransport,
)
from miles_core.data import parse_version


@dataclass(eq=False)
class Engine:
    """One engine server as the fleet knows it."""

    index: int
    url: str
    client: EngineClient
    #: the weight version it serves (as the fleet published it)
    version: int = 0
    #: it stopped answering: no request goes to it until it is back with the current weights
    down: bool = False
    #: its new server is up and waits for the weights (only then does it serve)
    restarted: bool = False
    #: times it was restarted; a group started before a restart knows it lost its engine
    restarts: int = 0


@dataclass(eq=False)
class Route:
    """Where generation requests go: one engine's client, or the router's over several."""

    client: EngineClient
    engines: list[Engine] = field(default_factory=list)

    @property
    def down(self) -> bool:
        """No engine behind it serves."""
        return all(e.down for e in self.engines)

    @property
    def version(self) -> int:
        """The oldest version any serving engine behind it has."""
        serving = [e.version for e in self.engines if not e.down]
        return min(serving) if serving else max(e.version for e in self.engines)


class RouteEngine:
    """A route as a rollout function sees it: ``generate`` only, with every result stamped
    with a numeric weight version (the engine's own, or the route's when the engine reports
    none it can use)."""

    def __init__(self, route: Route) -> None:
        self.route = route

    @property
    def base_url(self) -> str:
        """Where the requests go (an engine, or the router)."""
        return self.route.client.base_url

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One generation through the route's client."""
        result = await self.route.client.generate(input_ids, sampling_params, **kwargs)
        result.weight_version = str(parse_version(result.weight_version, self.route.version))
        return result


class AdapterRequests:
    """An engine client whose generations name the run's adapter (SGLang's ``lora_path``):
    with an ``adapter`` the fleet's weights are the adapter's, the transport publishes it alone
    (the engines keep the base from ``model_path``) and the policy is the adapter. Everything
    else goes to the client as it is."""

    def __init__(self, client: EngineClient, name: str) -> None:
        self.client = client
        self.lora_path = name

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One generation with the adapter (unless the caller names another)."""
        kwargs.setdefault("lora_path", self.lora_path)
        return await self.client.generate(input_ids, sampling_params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class RoutedRequests:
    """An engine whose generations ask for the routed experts (SGLang's
    ``return_routed_experts``): a run with ``rollout.routing`` wraps the engine every rollout
    function (and through it the session server) generates with, so each result carries the
    routing record of its sequence. Everything else goes to the engine as it is."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One generation that returns its routing record."""
        kwargs["return_routed_experts"] = True
        return await self.engine.generate(input_ids, sampling_params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def client_for(launcher: EngineLauncher, adapter: AdapterSync | None, url: str) -> EngineClient:
    """The launcher's client of the server (or router) at ``url``, its generations naming
    ``adapter`` when there is one."""
    client = launcher.client(url)
    if adapter is None:
        return client
    return AdapterRequests(client, adapter.name)  # type: ignore[return-value]


def send_weights(
    transport: WeightTransport,
    weights: Callable[..., AbstractContextManager[Iterable[tuple[str, Any]]]],
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


class EngineFleet:
    """Every engine of the run; see the module docstring."""

    #: how long an engine may take to answer /health before it counts as dead
    HEALTH_TIMEOUT_S = 20.0

    def __init__(
        self,
        launcher: EngineLauncher,
        transport: WeightTransport | None,
        *,
        model_path: str,
        weights: Callable[..., AbstractContextManager[Iterable[tuple[str, Any]]]] | None,
        router: Router | None = None,
        log: Callable[[str], None] = print,
        adapters: Sequence[AdapterSync] = (),
    ) -> None:
        """``transport`` and ``weights`` are ``None`` for engines whose weights never change
        (a distillation teacher's): a restarted engine then serves as soon as it is up, from
        ``model_path``, and :meth:`publish` is refused. ``adapters``: see :func:`send_weights`;
        with one, every generation names it (:class:`AdapterRequests`)."""
        self.adapters = list(adapters)
        self._client = partial(
            client_for, launcher, self.adapters[0] if len(self.adapters) == 1 else None
        )
        self.launcher = launcher
        self.transport = transport
        self.model_path = model_path
        self.weights = weights
        self.router = router if launcher.num_engines > 1 else None
        self.log = log
        self.engines: list[Engine] = []
        self.routes: list[Route] = []
        #: the version the trainer last published (what a restarted engine must get)
        self.version = 0
        self.restarts = self.router_restarts = 0
        #: set whenever a restarted engine is back and waits for the weights
        self.changed = asyncio.Event()
        #: set with the error of a restart that failed (the run stops)
        self.failure: asyncio.Future[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._update = asyncio.Lock()
        self._router_url: str | None = None

    # --- start and stop -----------------------------------------------------------------

    async def start(self, version: int) -> None:
        """Launch every engine (they start from the checkpoint on disk), then the router."""
        self.failure = asyncio.get_running_loop().create_future()
        self.version = version
        for i in range(self.launcher.num_engines):
            url = await asyncio.to_thread(self.launcher.launch, self.model_path, index=i)
            self.engines.append(Engine(i, url, self._client(url)))
        if self.router is not None:
            self._router_url = await asyncio.to_thread(self.router.start, self.urls())
            self.routes = [Route(self._client(self._router_url), list(self.engines))]
        else:
            self.routes = [Route(e.client, [e]) for e in self.engines]

    def generators(self) -> list[RouteEngine]:
        """What generation goes through now: each route with a serving engine behind it."""
        return [RouteEngine(r) for r in self.routes if not r.down]

    def urls(self, engines: Sequence[Engine] | None = None) -> list[str]:
        """Base URLs of ``engines`` (default: those serving)."""
        return [e.url for e in (self.serving() if engines is None else engines)]

    def serving(self) -> list[Engine]:
        """Engines that serve now."""
        return [e for e in self.engines if not e.down]

    async def close(self) -> None:
        """Let restarts under way finish (so the launcher knows every server to stop), then
        close the clients and the router. The launcher's shutdown is the run's last step."""
        await asyncio.gather(*self._restarts, return_exceptions=True)
        for client in [*(r.client for r in self.routes if self.router), *self._clients()]:
            try:
                await client.close()
            except Exception as exc:  # the run is ending: say what failed, close the rest
                self.log(f"closing the client of {client.base_url} failed: {exc!r}")
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)

    def _clients(self) -> list[EngineClient]:
        return [e.client for e in self.engines]

    # --- health and restart -------------------------------------------------------------

    async def alive(self, engine: Engine) -> bool:
        """Whether ``engine`` answers ``/health`` within :attr:`HEALTH_TIMEOUT_S` (a client
        error other than a dead or hung server propagates)."""
        try:
            return bool(await asyncio.wait_for(engine.client.health(), self.HEALTH_TIMEOUT_S))
        except asyncio.TimeoutError:
            return False

    async def find_dead(self, engines: Sequence[Engine] | None = None) -> list[Engine]:
        """Serving engines (of ``engines``, default all) that stopped answering; each is taken
        out of service and its restart begins."""
        await self._check_router()
        pool = [e for e in (self.engines if engines is None else engines) if not e.down]
        states = await asyncio.gather(*(self.alive(e) for e in pool))
        dead = [e for e, ok in zip(pool, states, strict=True) if not ok and not e.down]
        for engine in dead:
            self.begin_restart(engine)
        return dead

    async def _check_router(self) -> None:
        """A router process that stopped is started again over the serving engines."""
        if self.router is None or not self.serving() or self._router_url is None:
            return
        if await asyncio.to_thread(self.router.alive):
            return
        self.log("the router stopped answering: restarting it")
        await asyncio.to_thread(self.router.stop)
        self._router_url = await asyncio.to_thread(self.router.start, self.urls())
        route = self.routes[0]
        old, route.client = route.client, self._client(self._router_url)
        self.router_restarts += 1
        try:
            await old.close()
        except Exception as exc:  # its connections died with the router
            self.log(f"closing the old router client: {exc!r}")

    def begin_restart(self, engine: Engine) -> None:
        """Take ``engine`` out of service and restart it in the background; the other engines
        keep serving. It gets the weights at the next :meth:`publish`."""
        engine.down = True
        engine.restarted = False
        engine.restarts += 1
        self.restarts += 1  # counted when it begins, so a checkpoint right after has it
        task = asyncio.get_running_loop().create_task(self._restart(engine))
        self._restarts.add(task)
        task.add_done_callback(self._restart_done)

    def _restart_done(self, task: asyncio.Task[None]) -> None:
        self._restarts.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.failure is not None and not self.failure.done():  # it cannot be started again
            self.failure.set_exception(task.exception())  # type: ignore[arg-type]

    async def _restart(self, engine: Engine) -> None:
        self.log(f"engine {engine.index} stopped answering: restarting it")
        if self.router is not None:  # no request goes to it meanwhile
            await asyncio.to_thread(self.router.set_engines, self.urls())
        try:
            await engine.client.close()
        except Exception as exc:  # its connections died with it; nothing else to release
            self.log(f"engine {engine.index}: closing its old client: {exc!r}")
        # whatever is left of it (a hung server, a port) goes first
        await asyncio.to_thread(self.launcher.stop, engine.index)
        url = await asyncio.to_thread(self.launcher.launch, self.model_path, index=engine.index)
        engine.url, engine.client = url, self._client(url)
        if self.router is None:
            for route in self.routes:
                if engine in route.engines:
                    route.client = engine.client
        if self.transport is None:  # fixed weights: the checkpoint it loaded is the current one
            engine.down = False
            if self.router is not None:
                await asyncio.to_thread(self.router.set_engines, self.urls())
        else:
            engine.restarted = True
        self.changed.set()

    async def restarts_done(self) -> None:
        """Wait for every restart under way (raises the error of one that failed)."""
        while self._restarts:
            await asyncio.gather(*list(self._restarts))
        if self.failure is not None and self.failure.done():
            self.failure.result()

    async def heal(self) -> int:
        """Restart every engine that stopped answering and wait for it, then publish the
        current weights to the restarted ones. Returns how many were restarted."""
        dead = await self.find_dead()
        await self.restarts_done()
        if any(e.restarted for e in self.engines):
            await self.publish(self.version, only_restarted=True)
        return len(dead)

    # --- weights ----------------------------------------------------------------------------

    async def publish(
        self, version: int, *, pause: str | None = None, only_restarted: bool = False
    ) -> dict[str, float]:
        """Publish the trainer's weights as ``version`` to every serving engine and every
        restarted one (which then serves). With ``pause`` (SGLang's pause mode), generation
        pauses on the serving engines around the update and continues whatever happens. An
        engine that dies during the update is taken out and restarted, and the others get it
        again; when every engine is down, each gets the weights when it is back."""
        if self.transport is None or self.weights is None:
            raise PublishError("these engines serve fixed weights: nothing is published to them")
        async with self._update:
            self.version = version
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            for _ in range(1 + len(self.engines)):
                targets = [e for e in self.engines if e.restarted or not (e.down or only_restarted)]
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
        states = await asyncio.gather(*(self.alive(e) for e in targets))
        dead = [e for e, ok in zip(targets, states, strict=True) if not ok]
        for engine in dead:
            if not engine.down or engine.restarted:  # not restarting already
                self.begin_restart(engine)
        restarted = any(e.restarts != n for e, n in zip(targets, restarts, strict=True))
        return bool(dead) or restarted or any(e.down and not e.restarted for e in targets)

    async def _update_engines(self, targets: list[Engine], pause: str | None) -> dict[str, float]:
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
                engine.version = self.version
                if engine.restarted:  # now it has the weights: it serves
                    engine.down = engine.restarted = False
            if self.router is not None and back:  # it serves again, through the router too
                await asyncio.to_thread(self.router.set_engines, self.urls())
            return metrics
        finally:
            answers = await asyncio.gather(
                *(e.client.continue_generation() for e in live), return_exceptions=True
            )
            for engine, answer in zip(live, answers, strict=True):
                if isinstance(answer, BaseException):
                    self.log(f"engine {engine.index}: continue_generation failed: {answer!r}")
                    await self.find_dead([engine])

    async def _send(self, targets: list[Engine]) -> dict[str, float]:
        result: dict[str, Any] = {}
        try:
            result = await asyncio.to_thread(self._send_blocking, self.urls(targets))
        except Exception as exc:
            # What an engine keeps after a failed update is the transport's to say (its README):
            # the embedded engine stays on its previous weights and version.
            raise PublishError(f"weight update to version {self.version} failed: {exc}") from exc
        return {
            k if k.startswith("sync/") else f"sync/{k}": float(v)
            for k, v in result.items()
            if isinstance(v, (int, float))
        }

    def _send_blocking(self, urls: list[str]) -> dict[str, float]:
        assert self.transport is not None and self.weights is not None
        return send_weights(self.transport, self.weights, self.version, urls, self.adapters)

    # --- memory and capacity --------------------------------------------------------------

    async def release_memory(self) -> None:
        """Every serving engine releases its memory (the trainer is about to take it)."""
        await asyncio.gather(*(e.client.release_memory_occupation() for e in self.serving()))

    async def resume_memory(self) -> None:
        """Every serving engine takes its memory back."""
        await asyncio.gather(*(e.client.resume_memory_occupation() for e in self.serving()))

    async def capacity(self, route: Route, default: int) -> int:
        """Requests ``route`` runs at once: the sum of its engines' ``max_running_requests``
        (from ``/server_info``), else ``default``."""
        total = 0
        for engine in route.engines:
            try:
                info = await engine.client.get_server_info()
            except Exception as exc:
                self.log(f"engine {engine.index}: no server info ({exc!r}); assuming {default}")
                return default
            n = info.get("max_running_requests")
            if not n:
                return default
            total += int(n)
        return total
