"""The fully asynchronous schedule: the engines generate continuously into the bounded
:class:`~miles_core.buffer.GroupBuffer`; the trainer takes ``rollout.groups_per_step`` groups
from it, trains, and publishes its weights, for which generation pauses only during the update.

**Producer.** Every route (an engine, or the router over several) keeps up to ``N``
trajectories in flight (``N``: its engines' ``max_running_requests`` from ``/server_info``,
else ``groups_per_step x group_size``). A group starts on the least loaded route as soon as it
has a free trajectory slot. Each finished group is judged at arrival (the judge) and put in the
buffer. A full buffer blocks the producer (back-pressure): nothing is dropped for lack of room.

**Admission** (``buffer.admission: true``). A group starts only when it can be taken within
``buffer.max_staleness`` given the groups buffered and in flight ahead of it
(:mod:`.admission`); the producer holds it back otherwise, until the trainer has consumed
enough. The trainer takes the groups of the oldest weights first, the order the estimate counts
them in, so a group that generated for long is not queued behind those that overtook it.
Without it, every group a free slot allows starts, and the trainer takes groups in arrival
order.

**Trainer.** A group whose staleness (trainer version minus the oldest weight version of any of
its tokens) exceeds ``buffer.max_staleness`` is dropped at removal (``stale``): the last
resort, for a group that generated for longer than those started after it; with
``buffer.on_drop: retry`` the prompt of any dropped group is generated again.

**Weight update.** ``buffer.pause_mode``: ``retract`` aborts in-flight requests (SGLang's
``abort`` pause) and continues them after the update from the tokens they had, so every token's
version is exact; ``freeze`` pauses them in place (``in_place``) and stamps every token of a
request that spanned an update with the version it started with: pessimistic, never optimistic.

**Engine faults.** A failed group, or the health check every few seconds, finds a dead engine;
the fleet restarts it while the others generate, and it gets the weights at the next update (at
once when no engine is left to generate).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from miles_core.buffer import GroupBuffer
from miles_core.data import Group
from miles_core.errors import MilesUserError
from miles_core.ledger import IN_FLIGHT, DropReason
from miles_core.runtime.fleet import Route
from miles_core.runtime.schedules import ScheduleContext
from miles_core.runtime.schedules.admission import Admission
from miles_core.runtime.schedules.slots import (
    EngineSlots,
    GroupEngine,
    RouteSlots,
    restamp_versions,
)

# SGLang's pause mode for each of the schedule's.
_ENGINE_PAUSE = {"retract": "abort", "freeze": "in_place"}


class AsyncSchedule:
    """See the module docstring."""

    #: seconds between health checks of the serving engines (an idle engine that died is found
    #: too, not only one that fails a request)
    HEALTH_INTERVAL_S = 5.0

    def __init__(self, options: Any = None) -> None:
        self.ctx: ScheduleContext | None = None
        self.buffer: GroupBuffer | None = None
        self.admission: Admission | None = None
        self.slots = RouteSlots()
        self._tasks: set[asyncio.Task[None]] = set()  # groups in flight
        self._background: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._failed: asyncio.Future[None] | None = None
        self._stopped = False
        self._started = False
        self._version = 0
        self._step = 0
        self._blocked_s = 0.0
        self._blocked_since: float | None = None
        self._window_t0 = time.perf_counter()

    def attach(self, ctx: ScheduleContext) -> None:
        """Take the run's parts; called once before the first step."""
        self.ctx = ctx
        self.pause_mode = ctx.config.buffer.pause_mode

    # --- the producer -----------------------------------------------------------------------

    async def start(self, version: int) -> None:
        """Start generating (the first :meth:`next_batch` does it when nobody did)."""
        assert self.ctx is not None
        ctx = self.ctx
        b = ctx.config.buffer
        self.buffer = GroupBuffer(
            b.capacity,
            b.max_staleness,
            ctx.ledger,
            retry=ctx.rollouts.retry if b.on_drop == "retry" else None,
            oldest_first=b.admission,  # the order the admission estimate counts groups in
        )
        self.buffer.on_leave = self._wake.set  # the groups ahead of a held one went down
        r = ctx.config.rollout
        self.admission = Admission(b.max_staleness, r.groups_per_step, enabled=b.admission)
        self._version = version
        self._failed = asyncio.get_running_loop().create_future()
        await self._sync_routes()
        self._window_t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        for body in (self._produce(), self._watch(), self._forward_fleet_failure()):
            task = loop.create_task(body)
            task.add_done_callback(self._task_done)
            self._background.append(task)
        self._started = True

    async def _sync_routes(self) -> None:
        """Slots for every route of the fleet (an engine that joined brings one, down until
        it has the weights); the slots of a route whose engines left retire."""
        assert self.ctx is not None
        fleet, r = self.ctx.fleet, self.ctx.config.rollout
        for route in list(fleet.routes):
            if route in self.slots:
                continue
            capacity = await fleet.capacity(route, r.groups_per_step * r.group_size)
            if route in self.slots or route not in fleet.routes:
                continue  # another pass added it meanwhile, or it left
            slots = EngineSlots(route.client, capacity, route.version)
            slots.down = route.down
            slots.on_change = self._wake.set
            self.slots.add(route, slots)
        self.slots.retire(fleet.routes)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if task.cancelled() or task.exception() is None:
            return
        # A bug in a rollout function (which dropped its group) or in the producer: the run
        # fails at the trainer's next wait or when the producer stops.
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def _forward_fleet_failure(self) -> None:
        assert self.ctx is not None and self.ctx.fleet.failure is not None
        await self.ctx.fleet.failure  # raises when an engine cannot be started again

    def _full(self) -> bool:
        assert self.buffer is not None
        return len(self.buffer) >= self.buffer.capacity

    async def _produce(self) -> None:
        assert self.ctx is not None and self.buffer is not None
        ctx, loop = self.ctx, asyncio.get_running_loop()
        size = ctx.config.rollout.group_size
        assert self.admission is not None
        while not self._stopped:
            held = False  # a route has a free slot and the buffer room, admission says wait
            started = False
            while not self._stopped and not self._full():
                slots = self.slots.choose(ctx.fleet)
                if slots is None:
                    break  # every engine is restarting: the update after it wakes this loop
                if slots.load >= slots.capacity:
                    break
                held = not self._admits(slots)
                if held:
                    break  # the trainer's consuming wakes this loop
                prompt = ctx.rollouts.next_prompt()
                if prompt is None:
                    break
                # The view reserves the group's trajectories on the route now, before the task
                # first runs, so the next pass of this loop sees the route's new load.
                view = GroupEngine(slots, size)
                task = loop.create_task(self._run_group(prompt, view))
                self._tasks.add(task)
                task.add_done_callback(self._task_done)
                started = True
            now = time.perf_counter()
            if started or not held:  # a hold ends when a group starts
                self.admission.release(now)
            if held:
                self.admission.hold(now)
            # back-pressure: routes with room wait for the buffer
            if self._full() and self.slots.starved():
                if self._blocked_since is None:
                    self._blocked_since = now
            elif self._blocked_since is not None:
                self._blocked_s += now - self._blocked_since
                self._blocked_since = None
            if ctx.rollouts.exhausted and not self._tasks and not ctx.rollouts.retry:
                await self.buffer.close()  # the trainer takes what is left, then stops
                return
            self._wake.clear()
            await self._wake.wait()

    def _admits(self, slots: EngineSlots) -> bool:
        """Whether the admission rule lets a group start on ``slots`` now."""
        assert self.admission is not None and self.buffer is not None
        return self.admission.admits(
            ahead=len(self.buffer) + len(self._tasks),
            taken=self.buffer.taken,
            version=self._version,
            start_version=slots.version,
        )

    async def _run_group(self, prompt: dict[str, Any], view: GroupEngine) -> None:
        assert self.ctx is not None and self.buffer is not None
        ctx = self.ctx
        try:
            group = await ctx.rollouts.group(prompt, view, self._step, teach=False)
        finally:
            view.release()
        await ctx.rollouts.teach(group)  # its engine slot already generates the next group
        restamp_versions(group, view.records)
        reason = ctx.judge.verdict(group, self._step)
        if reason is not None and view.slots.left:  # its route left the job under it
            reason = DropReason.ENGINE_LEFT
        elif reason is DropReason.ENGINE_FAILED:  # its engine may have died under it
            route = self.slots.route_of(view.slots)
            if route is not None:
                await self._check_engines(route)
        if reason is not None:
            self.buffer.drop(group, reason)
        else:
            await self.buffer.put(group)  # waits while the buffer is full: back-pressure

    async def _check_engines(self, route: Route | None = None) -> None:
        """Find dead engines (of ``route``, default all); a route left without a serving
        engine stops taking requests until the update after its restart."""
        assert self.ctx is not None
        await self.ctx.fleet.find_dead(None if route is None else route.engines)
        await self._sync_routes()
        self.slots.found_dead()

    async def _watch(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.HEALTH_INTERVAL_S)
            await self._check_engines()

    # --- the trainer's side -----------------------------------------------------------------

    async def next_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Wait for ``groups_per_step`` groups. Meanwhile, when every engine is down and one is
        back, the trainer (idle, its weights still) publishes to it so generation goes on."""
        assert self.ctx is not None
        self._step = step
        if not self._started:
            await self.start(self.ctx.fleet.version)
        assert self.buffer is not None and self._failed is not None
        fleet = self.ctx.fleet
        t0 = time.perf_counter()
        n = self.ctx.config.rollout.groups_per_step
        getter = asyncio.ensure_future(self.buffer.get_batch(n, self._version))
        while not getter.done():
            await self._sync_routes()  # engines joined or left
            if self.slots.all_down() and any(e.restarted for e in fleet.engines):
                await self._update(self._version)
            fleet.changed.clear()
            changed = asyncio.ensure_future(fleet.changed.wait())
            waiting: set[asyncio.Future[Any]] = {getter, self._failed, changed}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if self._failed.done() and not getter.done():
                getter.cancel()
                self._failed.result()  # raises the producer's failure
        groups = getter.result()
        self._wake.set()  # the batch left room in the buffer
        if not groups:
            raise MilesUserError(
                f"step {step}: no group left to train on ({self.ctx.ledger.counts()}); the data "
                "source is exhausted"
            )
        wait_s = time.perf_counter() - t0
        return groups, {"time/rollout_s": wait_s, "trainer/wait_s": wait_s}

    async def publish(self, version: int) -> dict[str, float]:
        """Queued groups now beyond the bound make room; then the engines pause, take the
        weights and go on."""
        assert self.buffer is not None
        self._version = version
        await self.buffer.prune(version)
        self._wake.set()
        return await self._update(version)

    async def _update(self, version: int) -> dict[str, float]:
        assert self.ctx is not None
        t0 = time.perf_counter()
        await self._sync_routes()  # an engine that joined takes this update
        self.slots.close_gates(retract=self.pause_mode == "retract")
        try:
            metrics = await self.ctx.fleet.publish(version, pause=_ENGINE_PAUSE[self.pause_mode])
        finally:
            self.slots.updated()
            self._wake.set()
        metrics["time/paused_s"] = time.perf_counter() - t0
        return metrics

    async def metrics(self, version: int) -> dict[str, float]:
        """The producer's side since the previous step, and the buffer's state."""
        assert self.ctx is not None and self.buffer is not None
        now = time.perf_counter()
        wall = max(now - self._window_t0, 1e-9)
        self._window_t0 = now
        blocked = self._blocked_s
        if self._blocked_since is not None:
            blocked += now - self._blocked_since
            self._blocked_since = now
        self._blocked_s = 0.0
        tokens, busy, paused = 0, [], []
        for slots in self.slots.all():
            t, b, p = slots.take_window()
            tokens += t
            busy.append(b)
            paused.append(p)
        out = {
            "rollout/tokens_per_s": tokens / wall,
            "rollout/idle_fraction": 1.0 - statistics.fmean(busy) / wall if busy else 1.0,
            "rollout/paused_fraction": statistics.fmean(paused) / wall if paused else 0.0,
            "rollout/blocked_fraction": min(blocked / wall, 1.0),
            "rollout/trajectories_in_flight": float(sum(s.pending for s in self.slots.all())),
            "rollout/groups_in_flight": float(len(self._tasks)),
            "engine/down": float(sum(e.down for e in self.ctx.fleet.engines)),
        }
        assert self.admission is not None
        out.update(self.admission.take_window(wall, now))
        out.update(self.buffer.metrics(version))
        return out

    # --- the end ----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop generating: cancel every group in flight (closing its requests aborts them on
        the engine) and drop it, and every queued group, as ``run_ended``."""
        if not self._started or self._stopped:
            return
        assert self.ctx is not None and self._failed is not None
        self._stopped = True
        for slots in self.slots.all():
            slots.stopping = True
            slots.open_gate()
        tasks = [*self._background, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ledger = self.ctx.ledger
        for gid, state in ledger.state_dict()["state"].items():
            if state == IN_FLIGHT:  # a group this schedule started and cancelled
                ledger.drop(int(gid), DropReason.RUN_ENDED)
        if self.buffer is not None:
            self.buffer.clear(DropReason.RUN_ENDED)
        ledger.check()
        if self._failed.done():
            self._failed.result()  # a group failed after the trainer's last wait
