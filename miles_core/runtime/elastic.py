"""Engines that join and leave a running job: the fleet's membership changes.

**Join.** :meth:`Membership.join` starts more engines while the others serve (in the
background; the launcher places them, on Ray wherever a node has the resources an engine
reserves). When the engines can copy each other's weights (their record declares
``weights_from_peer``), a joined engine copies those an engine serving the current version
serves, between two updates, and takes requests at once; the engine it copies from goes on
generating. Otherwise (or when the copy fails) it waits, down, for the weights: it is a target
of the next weight update (the asynchronous schedule's update after the next step, the
synchronous schedule's heal before the next step), which the serving engines take anyway. Either
way none of them pauses for the join, and the new engine takes requests, through the router
too, only once it has the current weights.

**Leave.** :meth:`Membership.leave` takes an engine out for good (a drain, or a node going): no
request goes to it any more, the requests on it end (``pause_generation("abort")``), and its
server stops. A group whose requests ended that way is dropped as ``engine_left`` (generated
again with ``buffer.on_drop: retry``), never lost silently.

**Lost.** An engine that dies is restarted where it was; when that restart fails (its node is
gone, no node has room) and another engine still serves or is starting, the engine leaves the
job instead of failing the run. A run left with no engine fails, naming the error.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

from miles_core.contracts import PeerWeightsClient
from miles_core.errors import MilesUserError
from miles_core.runtime.routes import Engine, Route

if TYPE_CHECKING:
    from miles_core.runtime.fleet import EngineFleet


class Membership:
    """The fleet's joins and leaves; see the module docstring."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        #: engines that joined the running job, and engines that left it
        self.joined = self.left = self.join_failed = 0
        #: joined engines that copied a serving engine's weights, and the last copy's answer
        #: (``bytes``, ``seconds``..., with ``source``: the engine copied from)
        self.copied = 0
        self.last_copy: dict[str, Any] = {}
        self._next_index = 0
        self._joins: set[asyncio.Task[None]] = set()

    def started(self, count: int) -> None:
        """The fleet launched engines ``0 .. count - 1``; a joining one takes the next index."""
        self._next_index = count

    @property
    def joining(self) -> int:
        """Engines being started to join."""
        return len(self._joins)

    # --- join -------------------------------------------------------------------------------

    def join(self, count: int = 1) -> list[int]:
        """Start ``count`` more engines in the background; returns their indices. Each serves
        once it has the current weights (see the module docstring)."""
        if count < 1:
            raise MilesUserError(f"engines to join: a positive count (got {count})")
        indices = list(range(self._next_index, self._next_index + count))
        self._next_index += count
        loop = asyncio.get_running_loop()
        for index in indices:
            task = loop.create_task(self._join(index))
            self._joins.add(task)
            task.add_done_callback(self._joins.discard)
        return indices

    async def _join(self, index: int) -> None:
        fleet = self.fleet
        fleet.log(f"engine {index} joining: starting it")
        try:
            url = await asyncio.to_thread(fleet.launcher.launch, fleet.model_path, index=index)
        except Exception as exc:  # the job goes on with the engines it has
            self.join_failed += 1
            fleet.log(f"engine {index} could not join: {exc}")
            await asyncio.to_thread(fleet.launcher.stop, index)
            return
        engine = Engine(index, url, fleet.client(url), version=fleet.version)
        fixed = fleet.transport is None  # the checkpoint it loaded is what the others serve
        engine.down = engine.restarted = not fixed
        async with fleet.publisher.between_updates:
            copied = not fixed and fleet.peer_copy and await self._copy_weights(engine)
            if copied:
                engine.down = engine.restarted = False
            fleet.engines.append(engine)
            if fleet.router is not None and fleet.routes:
                fleet.routes[0].engines.append(engine)
            else:
                fleet.routes.append(Route(engine.client, [engine]))
        self.joined += 1
        if fixed or copied:
            await fleet.router_serves()
        if copied:
            since = " with the current weights"
        else:
            since = "" if fixed else ": it serves from the next weight update"
        fleet.log(f"engine {index} joined at {url}{since}")
        fleet.changed.set()

    #: seconds a joining engine may take to copy a serving engine's weights
    COPY_TIMEOUT_S = 600.0

    async def _copy_weights(self, engine: Engine) -> bool:
        """Have ``engine`` copy the weights of an engine that serves the fleet's version (run
        between two updates); whether it now serves that version."""
        fleet = self.fleet
        peers = [e for e in fleet.engines if not e.down and e.version == fleet.version]
        if not peers:
            return False
        peer = peers[0]
        try:
            client = cast(PeerWeightsClient, engine.client)
            answer = await client.pull_weights(peer.url, timeout_s=self.COPY_TIMEOUT_S)
        except Exception as exc:  # it waits for the next update instead
            fleet.log(f"engine {engine.index}: copying the weights of engine {peer.index}: {exc}")
            return False
        if str(answer.get("weight_version")) != str(fleet.version):
            fleet.log(
                f"engine {engine.index} copied version {answer.get('weight_version')!r} from "
                f"engine {peer.index}, not the fleet's {fleet.version}"
            )
            return False
        self.copied += 1
        self.last_copy = {**answer, "source": peer.index}
        mb = float(answer.get("bytes", 0)) / 1e6
        fleet.log(
            f"engine {engine.index} copied the weights of engine {peer.index} (version "
            f"{fleet.version}, {mb:.1f} MB in {float(answer.get('seconds', 0)):.2f} s)"
        )
        return True

    async def joins_done(self) -> None:
        """Wait for every join under way."""
        while self._joins:
            await asyncio.gather(*list(self._joins), return_exceptions=True)

    # --- leave ------------------------------------------------------------------------------

    def find(self, index: int) -> Engine:
        """The engine ``index`` of the job (refused, naming those there are, when none)."""
        for engine in self.fleet.engines:
            if engine.index == index:
                return engine
        have = sorted(e.index for e in self.fleet.engines)
        raise MilesUserError(f"no engine {index} in this job; its engines are {have}")

    async def leave(self, engine: Engine, why: str) -> None:
        """Take ``engine`` out of the job for good (see the module docstring)."""
        fleet = self.fleet
        if engine not in fleet.engines:
            return
        self._remove(engine)
        fleet.log(f"engine {engine.index} leaves the job ({why})")
        await fleet.router_serves()
        try:  # the requests on it end now, with finish reason abort
            await asyncio.wait_for(engine.client.pause_generation("abort"), 10)
        except Exception as exc:  # already dead or hung: stopping it ends them too
            fleet.log(f"engine {engine.index}: aborting its requests: {exc!r}")
        await asyncio.to_thread(fleet.launcher.stop, engine.index)
        try:
            await engine.client.close()
        except Exception as exc:  # its connections went with it
            fleet.log(f"engine {engine.index}: closing its client: {exc!r}")

    def lost(self, engine: Engine, error: BaseException) -> bool:
        """After ``engine`` could not be started again: it leaves the job when another engine
        serves or is starting (True), else the run has no engine left (False)."""
        others = [e for e in self.fleet.engines if e is not engine]
        if not others and not self._joins:
            return False
        self._remove(engine)
        self.fleet.log(
            f"engine {engine.index} could not be started again and leaves the job: {error}"
        )
        return True

    def _remove(self, engine: Engine) -> None:
        fleet = self.fleet
        engine.down, engine.restarted, engine.left = True, False, True
        fleet.engines.remove(engine)
        for route in list(fleet.routes):
            if engine in route.engines:
                route.engines.remove(engine)
                if not route.engines:
                    fleet.routes.remove(route)
        self.left += 1
        fleet.changed.set()
