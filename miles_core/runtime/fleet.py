"""The engine fleet: the one place that launches the engines, probes their health, restarts a
dead one and gives it the current weights before it serves, chooses the route each group
generates on, and publishes weight updates through the run's transport
(:mod:`miles_core.runtime.publish`). Both schedules use it; nothing else in the core talks to an
engine's control endpoints.

It lives on the run's event loop (the I/O thread). Routing: with more than one engine and a
router component (``sglang-router``), generation goes through the router and control calls go
to each engine directly; otherwise each engine is a route of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial

from miles_core.contracts import AdapterSync, EngineClient, EngineLauncher, Router, WeightTransport
from miles_core.errors import MilesUserError
from miles_core.runtime.elastic import Membership
from miles_core.runtime.publish import PublishError, WeightPublisher, Weights, send_weights
from miles_core.runtime.routes import (
    AdapterClient,
    AdapterRequests,
    Engine,
    Route,
    RoutedRequests,
    RouteEngine,
    client_for,
)

__all__ = [
    "AdapterClient",
    "AdapterRequests",
    "Engine",
    "EngineFleet",
    "PublishError",
    "Route",
    "RouteEngine",
    "RoutedRequests",
    "client_for",
    "send_weights",
]


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
        weights: Weights | None,
        router: Router | None = None,
        log: Callable[[str], None] = print,
        adapters: Sequence[AdapterSync] = (),
        peer_copy: bool = False,
    ) -> None:
        """``transport`` and ``weights`` are ``None`` for engines whose weights never change
        (a distillation teacher's): a restarted engine then serves as soon as it is up, from
        ``model_path``, and :meth:`publish` is refused. ``adapters``: see :func:`send_weights`;
        with one, every generation names it (:class:`AdapterClient`). ``peer_copy``: the
        engines' clients are :class:`~miles_core.contracts.PeerWeightsClient` (their record
        declares ``weights_from_peer``), so an engine that joins copies the weights another
        serves (not when the run trains adapters: the copy is of the base weights alone)."""
        self.adapters = list(adapters)
        self.peer_copy = peer_copy and not self.adapters
        self._client = partial(
            client_for, launcher, self.adapters[0] if len(self.adapters) == 1 else None
        )
        self.launcher = launcher
        self.transport = transport
        self.model_path = model_path
        self.publisher = WeightPublisher(self, transport, weights, self.adapters)
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
        self._router_url: str | None = None
        #: engines joining and leaving the running job
        self.membership = Membership(self)

    @property
    def router_url(self) -> str | None:
        """The router's URL while it runs (``None``: no router)."""
        return self._router_url

    # --- start and stop -----------------------------------------------------------------

    async def start(self, version: int) -> None:
        """Launch every engine (they start from the checkpoint on disk), then the router."""
        self.failure = asyncio.get_running_loop().create_future()
        self.version = version
        self.membership.started(self.launcher.num_engines)
        for i in range(self.launcher.num_engines):
            url = await asyncio.to_thread(self.launcher.launch, self.model_path, index=i)
            engine = Engine(i, url, self.client(url))
            self.engines.append(engine)
            await self._reach(engine)
        if self.router is not None:
            self._router_url = await asyncio.to_thread(self.router.start, self.urls())
            self.routes = [Route(self.client(self._router_url), list(self.engines))]
        else:
            self.routes = [Route(e.client, [e]) for e in self.engines]

    def client(self, url: str) -> EngineClient:
        """A client for the engine (or router) at ``url``, naming the run's adapter when it
        trains one."""
        return self._client(url)

    def choose_route(
        self,
        turn: int = 0,
        *,
        load: Callable[[Route], float] | None = None,
        usable: Callable[[Route], bool] | None = None,
    ) -> Route | None:
        """The route a group generates on: of the usable routes (default: those with a serving
        engine), the least loaded by ``load`` (default: none is), the first in the fleet's
        order rotated by ``turn`` among equals; ``None`` when none is usable."""
        routes = [r for r in self.routes if (usable(r) if usable else not r.down)]
        if not routes:
            return None
        rotated = [routes[(turn + i) % len(routes)] for i in range(len(routes))]
        return min(rotated, key=load) if load is not None else rotated[0]

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
        """Let restarts and joins under way finish (so the launcher knows every server to
        stop), then close the clients and the router. The launcher's shutdown is the run's
        last step."""
        await asyncio.gather(*self._restarts, return_exceptions=True)
        await self.membership.joins_done()
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

    async def _reach(self, engine: Engine) -> None:
        """Refuse the run when this process cannot reach a started engine at the URL it
        advertises (on another node: its node's address), within :attr:`HEALTH_TIMEOUT_S`."""
        if await self.alive(engine):
            return
        raise MilesUserError(
            f"engine {engine.index} started, but this process cannot reach it at {engine.url} "
            f"within {self.HEALTH_TIMEOUT_S:g} s: the engine binds and advertises its node's "
            "address, which must be reachable from the node that runs `miles train` (a "
            "firewall between the nodes, a node address Ray chose that other nodes cannot "
            "route to: set it with `ray start --node-ip-address`, or the engine's host option)"
        )

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
        old, route.client = route.client, self.client(self._router_url)
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
        task.add_done_callback(partial(self._restart_done, engine))

    def _restart_done(self, engine: Engine, task: asyncio.Task[None]) -> None:
        self._restarts.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.membership.lost(engine, task.exception()):  # type: ignore[arg-type]
            return  # it cannot be started again; the others serve on
        if self.failure is not None and not self.failure.done():  # the run has no engine left
            self.failure.set_exception(task.exception())  # type: ignore[arg-type]

    async def _restart(self, engine: Engine) -> None:
        self.log(f"engine {engine.index} stopped answering: restarting it")
        await self.router_serves()  # no request goes to it meanwhile
        try:
            await engine.client.close()
        except Exception as exc:  # its connections died with it; nothing else to release
            self.log(f"engine {engine.index}: closing its old client: {exc!r}")
        # whatever is left of it (a hung server, a port) goes first
        await asyncio.to_thread(self.launcher.stop, engine.index)
        url = await asyncio.to_thread(self.launcher.launch, self.model_path, index=engine.index)
        if engine.left:  # drained while it restarted
            await asyncio.to_thread(self.launcher.stop, engine.index)
            return
        engine.url, engine.client = url, self.client(url)
        if self.router is None:
            for route in self.routes:
                if engine in route.engines:
                    route.client = engine.client
        if self.transport is None:  # fixed weights: the checkpoint it loaded is the current one
            engine.down = False
            await self.router_serves()
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

    async def router_serves(self) -> None:
        """The router (when there is one) sends requests to the serving engines only."""
        if self.router is not None:
            await asyncio.to_thread(self.router.set_engines, self.urls())

    # --- weights ----------------------------------------------------------------------------

    async def publish(
        self, version: int, *, pause: str | None = None, only_restarted: bool = False
    ) -> dict[str, float]:
        """Publish the trainer's weights as ``version`` to every serving engine and every
        restarted one (which then serves). With ``pause`` (SGLang's pause mode), generation
        pauses on the serving engines around the update and continues whatever happens. An
        engine that dies during the update is taken out and restarted, and the others get it
        again; when every engine is down, each gets the weights when it is back."""
        return await self.publisher.publish(version, pause=pause, only_restarted=only_restarted)

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
