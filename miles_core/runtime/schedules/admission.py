"""Admission control of the fully asynchronous schedule (``buffer.admission``): a prompt's
group starts only when it can be taken by the trainer within the staleness bound, given the
work queued ahead of it.

The trainer takes ``groups_per_step`` groups a step, those of the oldest weights first
(:class:`~miles_core.buffer.GroupBuffer` with ``oldest_first``), and its version goes up by
one after each step. A group started now has ahead of it every group buffered and every group
in flight (each started on weights no newer than its own), and the trainer, at version ``v``,
already took ``taken`` groups at ``v`` (all of its batch, while it trains). So it is taken at
version ``v + (taken + ahead) // groups_per_step``, and its staleness then is that version
minus the version its engine serves now (its oldest token can be no older). A group whose
estimate exceeds ``buffer.max_staleness`` would only be generated to be discarded: it waits
until the trainer has consumed enough. The discard at removal stays as the last resort: a
group that generates for more versions than the bound, or is overtaken by groups started on
the same weights, can still go stale.
"""

from __future__ import annotations

import time


def consumed_at(*, ahead: int, taken: int, per_step: int, version: int) -> int:
    """The trainer version at which a group started now is taken: ``ahead`` groups (buffered
    and in flight) go before it, and the trainer, at ``version``, already took ``taken``
    groups at it (``per_step`` of them while it trains on them: it takes the next batch at
    ``version + 1``)."""
    if per_step < 1:
        raise ValueError(f"per_step must be at least 1, got {per_step}")
    if ahead < 0 or taken < 0:
        raise ValueError(f"ahead and taken must be >= 0, got {ahead} and {taken}")
    return version + (taken + ahead) // per_step


class Admission:
    """The admission rule and what it held back. ``enabled`` False admits every group (the
    discard at removal alone bounds staleness)."""

    def __init__(self, max_staleness: int, per_step: int, *, enabled: bool = True) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if per_step < 1:
            raise ValueError(f"per_step must be at least 1, got {per_step}")
        self.max_staleness = max_staleness
        self.per_step = per_step
        self.enabled = enabled
        self._holds = 0  # holds that began in the current metrics window
        self._held_s = 0.0
        self._held_since: float | None = None

    def estimate(self, *, ahead: int, taken: int, version: int, start_version: int) -> int:
        """The staleness a group started now on weights ``start_version`` would have when the
        trainer (at ``version``, ``taken`` groups taken at it) takes it."""
        taken_at = consumed_at(ahead=ahead, taken=taken, per_step=self.per_step, version=version)
        return taken_at - start_version

    def admits(self, *, ahead: int, taken: int, version: int, start_version: int) -> bool:
        """Whether a group may start now, the trainer being at ``version`` with ``taken``
        groups taken at it. While its batch is not complete and nothing is ahead, a group
        always may (an engine still on older weights included): the trainer waits for it,
        nothing else would wake the producer, and the run would stop."""
        if not self.enabled or (ahead == 0 and taken < self.per_step):
            return True
        staleness = self.estimate(
            ahead=ahead, taken=taken, version=version, start_version=start_version
        )
        return staleness <= self.max_staleness

    @property
    def holding(self) -> bool:
        """Whether the producer holds a group back now."""
        return self._held_since is not None

    def hold(self, now: float | None = None) -> None:
        """The producer holds a group back (from ``now`` on, when it was not already)."""
        if self._held_since is None:
            self._held_since = time.perf_counter() if now is None else now
            self._holds += 1

    def release(self, now: float | None = None) -> None:
        """The producer starts groups again."""
        if self._held_since is not None:
            now = time.perf_counter() if now is None else now
            self._held_s += now - self._held_since
            self._held_since = None

    def take_window(self, wall_s: float, now: float | None = None) -> dict[str, float]:
        """Holds begun and seconds held since the last call, over ``wall_s`` seconds."""
        now = time.perf_counter() if now is None else now
        held_s = self._held_s
        if self._held_since is not None:  # a hold that goes on counts up to now
            held_s += now - self._held_since
            self._held_since = now
        holds, self._holds, self._held_s = self._holds, 0, 0.0
        return {
            "admission/held": float(holds),
            "admission/held_s": held_s,
            "admission/held_fraction": min(held_s / max(wall_s, 1e-9), 1.0),
        }
