"""The bounded group buffer of the fully asynchronous loop.

Engines put complete groups in; the trainer takes batches out. A full buffer blocks the
producer (back-pressure): it never drops to make room. Groups are dropped, with a reason in
the ledger, at two moments only:

* at arrival: a group with an aborted or failed sample (``aborted`` / ``failed``), or one the
  group filter rejects (``filtered``);
* at removal: a group whose staleness exceeds the bound (``stale``). Staleness grows while a
  group waits, so it can only be judged when the trainer takes it.

Staleness is pessimistic: current trainer version minus the oldest weight version of any
generated token of any sample of the group. With ``on_drop="retry"`` the prompts of dropped
groups are queued for the producer to generate again.

The buffer lives on one asyncio event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from miles_core.data import Group
from miles_core.ledger import DROP_ABORTED, DROP_FAILED, DROP_FILTERED, DROP_STALE, Ledger


def arrival_drop_reason(group: Group, keep: Callable[[Group], bool] | None = None) -> str | None:
    """Why a finished group is dropped on arrival (``aborted``, ``failed`` or ``filtered`` by
    ``keep``), or ``None`` to keep it. The synchronous loop judges its groups the same way."""
    if group.failed:
        aborted = any(s.finish_reason == "abort" for s in group.samples)
        return DROP_ABORTED if aborted else DROP_FAILED
    if keep is not None and not keep(group):
        return DROP_FILTERED
    return None


class GroupBuffer:
    """Bounded FIFO of complete groups with staleness-bounded removal."""

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        ledger: Ledger,
        *,
        group_filter: Callable[[Group], bool] | None = None,
        retry_dropped: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError("buffer capacity must be at least 1 group")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.ledger = ledger
        self.group_filter = group_filter
        self.retry_dropped = retry_dropped
        self._queue: deque[Group] = deque()
        self._changed = asyncio.Condition()
        self.retry_prompts: deque[dict[str, Any]] = deque()
        self.drops: Counter[str] = Counter()
        self._consumed_staleness: list[int] = []
        self.closed = False

    def __len__(self) -> int:
        return len(self._queue)

    def drop(self, group: Group, reason: str) -> None:
        """Drop a group with a reason (counted here and in the ledger); with retry, its prompt
        is queued to be generated again. The loop uses it for groups it judged itself."""
        self._drop(group, reason)

    def _drop(self, group: Group, reason: str) -> None:
        self.ledger.drop(group.group_id, reason)
        self.drops[reason] += 1
        if self.retry_dropped:
            self.retry_prompts.append(group.prompt)

    async def put(self, group: Group) -> bool:
        """Judge a finished group at arrival; buffer it (waiting while full) or drop it.
        Returns True if it was buffered."""
        reason = arrival_drop_reason(group, self.group_filter)
        if reason is not None:
            self._drop(group, reason)
            return False
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._queue) < self.capacity)
            self._queue.append(group)
            self.ledger.buffer(group.group_id)
            self._changed.notify_all()
        return True

    async def close(self) -> None:
        """No group will be put any more: a waiting :meth:`get_batch` returns what it has."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def get_batch(self, n: int, current_version: int) -> list[Group]:
        """Wait for ``n`` groups within the staleness bound, oldest first; stale ones met on the
        way are dropped. The returned groups are recorded as trained. Once the buffer is
        closed and empty, returns the (possibly shorter) batch it has."""
        batch: list[Group] = []
        async with self._changed:
            while len(batch) < n:
                await self._changed.wait_for(lambda: len(self._queue) > 0 or self.closed)
                if not self._queue:
                    break
                group = self._queue.popleft()
                self._changed.notify_all()  # room for a blocked producer
                staleness = group.staleness(current_version)
                if staleness > self.max_staleness:
                    self._drop(group, DROP_STALE)
                    continue
                self._consumed_staleness.append(staleness)
                batch.append(group)
        for group in batch:
            self.ledger.train(group.group_id)
        return batch

    def drop_stale(self, current_version: int) -> int:
        """Drop every queued group already beyond the bound (e.g. right after a weight update);
        returns how many were dropped."""
        keep: deque[Group] = deque()
        dropped = 0
        for group in self._queue:
            if group.staleness(current_version) > self.max_staleness:
                self._drop(group, DROP_STALE)
                dropped += 1
            else:
                keep.append(group)
        self._queue = keep
        return dropped

    async def prune(self, current_version: int) -> int:
        """:meth:`drop_stale`, then wake a producer waiting for the room it made."""
        async with self._changed:
            dropped = self.drop_stale(current_version)
            self._changed.notify_all()
        return dropped

    def clear(self, reason: str) -> int:
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
