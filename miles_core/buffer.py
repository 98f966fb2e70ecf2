"""The bounded group buffer of the fully asynchronous schedule.

Engines put complete, already judged groups in (:mod:`miles_core.runtime.judge` decides at
arrival); the trainer takes batches out, in arrival order, or with ``oldest_first`` the
groups of the oldest weights first (in arrival order among equals), so that a group that
generated for long is not queued behind the groups that overtook it. A full buffer blocks the
producer (back-pressure): it never drops to make room. The buffer itself drops a group for one
reason only: at removal, when its staleness exceeds the bound (``stale``). Staleness grows
while a group waits, so it can only be judged when the trainer takes it.

Staleness is pessimistic: current trainer version minus the oldest weight version of any
generated token of any sample of the group. With ``retry`` the prompts of dropped
groups are queued for the producer to generate again.

The buffer lives on one asyncio event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from miles_core.data import Group, Prompt
from miles_core.ledger import DropReason, Ledger


class GroupBuffer:
    """Bounded queue of complete groups with staleness-bounded removal, in arrival order or
    (``oldest_first``) oldest weights first."""

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        ledger: Ledger,
        *,
        retry: deque[dict[str, Any]] | None = None,
        oldest_first: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError("buffer capacity must be at least 1 group")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.ledger = ledger
        #: take the groups of the oldest weights first (False: in arrival order)
        self.oldest_first = oldest_first
        self._queue: deque[Group] = deque()
        self._changed = asyncio.Condition()
        #: where the prompts of dropped groups go to be generated again (``None``: nowhere)
        self.retry_prompts = retry
        self.drops: Counter[str] = Counter()
        self._consumed_staleness: list[int] = []
        self.closed = False
        #: groups the trainer took at its current version (:meth:`prune` with a new version
        #: starts the count again): the producer's admission rule counts them as consumed
        self.taken = 0
        #: called whenever a group leaves the queue (the producer's admission rule counts the
        #: groups ahead of a new one)
        self.on_leave: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self._queue)

    def drop(self, group: Group, reason: DropReason) -> None:
        """Drop a group with a reason (counted here and in the ledger); with retry, its prompt
        is queued to be generated again."""
        self._drop(group, reason)

    def _drop(self, group: Group, reason: DropReason) -> None:
        self.ledger.drop(group.group_id, reason)
        self.drops[DropReason(reason).value] += 1
        if self.retry_prompts is not None:
            self.retry_prompts.append(Prompt(group.prompt, group.adapter))

    async def put(self, group: Group) -> None:
        """Queue a group that was kept at arrival, waiting while the buffer is full."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._queue) < self.capacity)
            self._queue.append(group)
            self.ledger.buffer(group.group_id)
            self._changed.notify_all()

    async def close(self) -> None:
        """No group will be put any more: a waiting :meth:`get_batch` returns what it has."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def get_batch(self, n: int, current_version: int) -> list[Group]:
        """Wait for ``n`` groups within the staleness bound, oldest first; stale ones met on the
        way are dropped (the run records the returned ones as trained after its train step).
        Once the buffer is closed and empty, returns the (possibly shorter) batch it has."""
        batch: list[Group] = []
        async with self._changed:
            while len(batch) < n:
                await self._changed.wait_for(lambda: len(self._queue) > 0 or self.closed)
                if not self._queue:
                    break
                group = self._pop_oldest(current_version)
                self._changed.notify_all()  # room for a blocked producer
                staleness = group.staleness(current_version)
                if staleness > self.max_staleness:
                    self._drop(group, DropReason.STALE)
                else:
                    self._consumed_staleness.append(staleness)
                    batch.append(group)
                    self.taken += 1
                self.on_leave()
        return batch

    def _pop_oldest(self, current_version: int) -> Group:
        """Remove and return the queued group of the oldest weights (the first to arrive among
        equals): a group that generated for long is taken before it crosses the bound, not
        after every group that overtook it."""
        queue = self._queue
        if not self.oldest_first:
            return queue.popleft()
        index, oldest = 0, queue[0].staleness(current_version)
        for i, group in enumerate(queue):
            staleness = group.staleness(current_version)
            if staleness > oldest:
                index, oldest = i, staleness
        group = queue[index]
        del queue[index]
        return group

    def drop_stale(self, current_version: int) -> int:
        """Drop every queued group already beyond the bound (e.g. right after a weight update);
        returns how many were dropped."""
        keep: deque[Group] = deque()
        dropped = 0
        for group in self._queue:
            if group.staleness(current_version) > self.max_staleness:
                self._drop(group, DropReason.STALE)
                dropped += 1
            else:
                keep.append(group)
        self._queue = keep
        if dropped:
            self.on_leave()
        return dropped

    async def prune(self, current_version: int) -> int:
        """At a new trainer version: :meth:`drop_stale`, then wake a producer waiting for the
        room it made; no group is taken at the new version yet."""
        async with self._changed:
            self.taken = 0
            dropped = self.drop_stale(current_version)
            self._changed.notify_all()
        return dropped

    def clear(self, reason: DropReason) -> int:
        """Drop every queued group with ``reason`` (the run ends); returns how many."""
        queued, self._queue = list(self._queue), deque()
        for group in queued:
            self._drop(group, reason)
        return len(queued)

    def metrics(self, current_version: int) -> dict[str, float]:
        """Queue size, staleness of consumed (since the last call) and queued groups, drops."""
        queued = [g.staleness(current_version) for g in self._queue]
        consumed, self._consumed_staleness = self._consumed_staleness, []
        out: dict[str, float] = {
            "buffer/size": float(len(self._queue)),
            "buffer/capacity": float(self.capacity),
            "staleness/consumed_mean": statistics.fmean(consumed) if consumed else 0.0,
            "staleness/consumed_max": float(max(consumed, default=0)),
            "staleness/queued_mean": statistics.fmean(queued) if queued else 0.0,
            "staleness/queued_max": float(max(queued, default=0)),
        }
        for reason, count in sorted(self.drops.items()):
            out[f"drops/{reason}"] = float(count)
        return out
