"""The asynchronous schedule's view of a route: trajectory slots, the pause gate, retracted
requests continued after an update, and every generated token's weight version."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from miles_core.data import Group
from miles_core.runtime.fleet import EngineFleet, Route


class EngineSlots:
    """One route (an engine, or the router over several) as the producer sees it: at most
    ``capacity`` trajectories run on it at once, new requests wait while generation is paused
    for a weight update, requests retracted by a pause are continued after it, and every
    generated token's weight version is recorded.

    ``version`` is the weight version its engines serve; the schedule sets it after each
    update. ``client`` is what generation goes through (it changes when an engine restarts).
    """

    def __init__(self, client: Any, capacity: int, version: int) -> None:
        if capacity < 1:
            raise ValueError("an engine needs at least one trajectory slot")
        self.client = client
        self.capacity = capacity
        self.version = version
        self.pending = 0  # generate calls not finished: running, or waiting for a slot
        self.reserved = 0  # trajectories of started groups that have not called generate yet
        self.paused = False
        self.stopping = False
        #: no engine behind it serves (each is restarting)
        self.down = False
        #: its route left the job: a group that failed on it is dropped as ``engine_left``
        self.left = False
        self.restarts = 0  # the groups started before a restart know they lost their engine
        self.on_change: Callable[[], None] = lambda: None
        self._slots = asyncio.Semaphore(capacity)
        self._open = asyncio.Event()
        self._open.set()
        self._active: set[str] = set()  # request ids on the engine now
        self._retracted: set[str] = set()
        # Accounting of the current metrics window.
        self._tokens = 0
        self._busy_s = 0.0
        self._paused_s = 0.0
        self._mark = time.perf_counter()

    @property
    def on_engine(self) -> int:
        """Requests sent to the engine and not answered yet (not those waiting for a slot or
        at a closed gate: an engine that dies now fails these, the others go on after its
        restart)."""
        return len(self._active)

    @property
    def load(self) -> int:
        """Trajectories this engine owes: pending calls plus those groups will still start."""
        return self.pending + self.reserved

    def _tick(self) -> None:
        now = time.perf_counter()
        dt, self._mark = now - self._mark, now
        if self.paused or self.down:
            self._paused_s += dt
        else:
            self._busy_s += dt * min(len(self._active), self.capacity) / self.capacity

    def take_window(self) -> tuple[int, float, float]:
        """(tokens generated, slot-busy seconds, paused seconds) since the last call."""
        self._tick()
        out = (self._tokens, self._busy_s, self._paused_s)
        self._tokens, self._busy_s, self._paused_s = 0, 0.0, 0.0
        return out

    def close_gate(self, *, retract: bool) -> None:
        """Stop sending requests (before the engine is paused); with ``retract``, the requests
        on the engine now will be continued when their abort comes back."""
        self._tick()
        self.paused = True
        self._open.clear()
        if retract:
            self._retracted |= self._active

    def open_gate(self) -> None:
        """Send requests again (after the engine resumed)."""
        self._tick()
        self.paused = False
        self._open.set()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        record: list[tuple[tuple[int, ...], tuple[float, ...], list[int]]] | None = None,
        **extra: Any,
    ) -> Any:
        """One generation in a trajectory slot of this engine. The result is the client's,
        with ``weight_version`` set to the oldest version of its tokens; ``record`` (when
        given) receives (token ids, log-probs, per-token versions); ``extra`` goes with every
        request of it (``lora_path``)."""
        self.pending += 1
        try:
            async with self._slots:
                return await self._generate(
                    list(input_ids),
                    dict(sampling_params or {}),
                    return_logprob,
                    rid,
                    record,
                    extra,
                )
        finally:
            self.pending -= 1
            self.on_change()

    async def _generate(
        self,
        prompt: list[int],
        params: dict[str, Any],
        return_logprob: bool,
        rid: str | None,
        record: list[tuple[tuple[int, ...], tuple[float, ...], list[int]]] | None,
        extra: dict[str, Any],
    ) -> Any:
        budget = params.get("max_new_tokens")
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routed: Any = None  # the routing record, continued across retracted requests
        while True:
            await self._open.wait()
            # Nothing awaits between the gate and the request's registration, so a pause
            # either sees this request as active or stops it at the gate.
            request_id = rid if rid is not None and not ids else f"miles-{uuid.uuid4().hex}"
            version = self.version
            part = dict(params)
            if ids:  # the continuation of a retracted request
                if budget is not None:
                    part["max_new_tokens"] = int(budget) - len(ids)
                seed = params.get("sampling_seed")
                if seed is not None:  # a fresh stream for the tokens still to sample
                    part["sampling_seed"] = (int(seed) * 1_000_003 + len(ids)) % 2**31
            self._tick()
            self._active.add(request_id)
            try:
                result = await self.client.generate(
                    prompt + ids, part, return_logprob=return_logprob, rid=request_id, **extra
                )
            finally:
                self._tick()
                self._active.discard(request_id)
                retracted = request_id in self._retracted
                self._retracted.discard(request_id)
            out = list(result.output_ids)
            self._tokens += len(out)
            ids += out
            logprobs += list(result.logprobs)
            versions += [version] * len(out)
            part_routed = result.routed_experts
            if part_routed is not None:
                # A continuation forwards the earlier tokens again: their rows stay those of
                # the request that generated them.
                routed = part_routed if routed is None else routed.extend(part_routed)
            finish = result.finish_reason
            left = None if budget is None else int(budget) - len(ids)
            if retracted and finish == "abort" and not self.stopping:
                if left is None or left > 0:
                    continue
                finish = "length"  # retracted exactly at its budget
            break
        final = copy.copy(result)
        final.finish_reason = finish
        final.output_ids = ids
        final.logprobs = logprobs
        final.weight_version = str(min(versions, default=version))
        if routed is not None:
            final.routed_experts = routed
        if record is not None:
            record.append((tuple(ids), tuple(logprobs), versions))
        return final


class GroupEngine:
    """The engine as one group's rollout sees it: each trajectory it starts moves from the
    engine's ``reserved`` count to its ``pending`` one, and its generations' versions are kept
    for :func:`restamp_versions`."""

    def __init__(self, slots: EngineSlots, trajectories: int) -> None:
        self.slots = slots
        self.unstarted = trajectories
        self.records: list[tuple[tuple[int, ...], tuple[float, ...], list[int]]] = []
        self.restarts = slots.restarts
        slots.reserved += trajectories

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.unstarted:
            self.unstarted -= 1
            self.slots.reserved -= 1
        return await self.slots.generate(input_ids, sampling_params, record=self.records, **kwargs)

    @property
    def base_url(self) -> str:
        """Where this group's requests go (an engine, or the router)."""
        return str(self.slots.client.base_url)

    def release(self) -> None:
        """The group ended: whatever it did not start no longer counts on the engine."""
        self.slots.reserved -= self.unstarted
        self.unstarted = 0


class RouteSlots:
    """The producer's :class:`EngineSlots` of every route of the fleet, in the fleet's order,
    and what keeps them in step with their routes."""

    def __init__(self) -> None:
        self._by_route: dict[Route, EngineSlots] = {}

    def add(self, route: Route, slots: EngineSlots) -> None:
        """``route``'s slots."""
        self._by_route[route] = slots

    def __iter__(self) -> Iterator[tuple[Route, EngineSlots]]:
        return iter(self._by_route.items())

    def all(self) -> list[EngineSlots]:
        """Every route's slots."""
        return list(self._by_route.values())

    def __contains__(self, route: Route) -> bool:
        return route in self._by_route

    def route_of(self, slots: EngineSlots) -> Route | None:
        """The route of ``slots`` (``None``: it left the job)."""
        return next((r for r, s in self._by_route.items() if s is slots), None)

    def retire(self, routes: Sequence[Route]) -> None:
        """The slots of every route not in ``routes`` (its engines left the job) retire: no
        group starts on them, and requests waiting at their gate go on, to fail there."""
        for route in [r for r in self._by_route if r not in routes]:
            slots = self._by_route.pop(route)
            slots.down = slots.left = True
            slots.open_gate()

    def choose(self, fleet: EngineFleet) -> EngineSlots | None:
        """The slots of the route the fleet chooses for the next group: the least loaded of
        those not down; ``None`` when every one is down. A route of an engine that joined
        counts once it has slots (the schedule adds them before the engine serves)."""
        by_route = self._by_route
        route = fleet.choose_route(
            load=lambda r: by_route[r].load / by_route[r].capacity,
            usable=lambda r: r in by_route and not by_route[r].down,
        )
        return None if route is None else by_route[route]

    def starved(self) -> bool:
        """Whether a route that is not down has a free trajectory slot."""
        return any(s.load < s.capacity for s in self._by_route.values() if not s.down)

    def all_down(self) -> bool:
        """Whether no route takes requests (each one's engines are restarting)."""
        return all(s.down for s in self._by_route.values())

    def found_dead(self) -> None:
        """After the fleet looked for dead engines: a route left without a serving engine
        stops taking requests until the update after its restart."""
        for route, slots in self._by_route.items():
            if not route.down:
                slots.client = route.client  # the router's, when it was restarted
            if route.down and not slots.down:
                slots.down = True
                slots.restarts += 1
                slots.close_gate(retract=False)

    def close_gates(self, *, retract: bool) -> None:
        """Before a weight update: no new request goes to a route that takes requests."""
        for slots in self._by_route.values():
            if not slots.down:
                slots.close_gate(retract=retract)

    def updated(self) -> None:
        """After a weight update (or its failure): every route's client and version, a
        restarted route that has the weights now taking requests again."""
        for route, slots in self._by_route.items():
            slots.client = route.client  # a restarted engine has a new client
            slots.version = route.version
            if slots.down and not route.down:  # restarted, and it has the weights now
                slots.down = False
            if not slots.down:
                slots.open_gate()


def restamp_versions(
    group: Group, records: Sequence[tuple[tuple[int, ...], tuple[float, ...], list[int]]]
) -> None:
    """Give every run of generated tokens that is exactly one recorded generation (same ids,
    same log-probs) that generation's per-token versions. Runs that match none keep what the
    rollout stamped: the oldest version of the generation, which is pessimistic, never wrong
    about a group's oldest version."""
    table: dict[tuple[tuple[int, ...], tuple[float, ...]], list[int]] = {}
    for ids, logprobs, versions in records:
        table.setdefault((ids, logprobs), versions)
    for sample in group.samples:
        mask, n, i = sample.loss_mask, len(sample.loss_mask), 0
        while i < n:
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < n and mask[j]:
                j += 1
            key = (tuple(sample.response_ids[i:j]), tuple(sample.logprobs[i:j]))
            found = table.get(key)
            if found is not None and len(found) == j - i:
                sample.versions[i:j] = found
            i = j
