"""Deadlines: every wait of a transport is bounded and fails with a message naming the wait."""

from __future__ import annotations

import time
from collections.abc import Callable

from miles_transport_common.errors import TransportTimeout


class Deadline:
    """A point in time after which waiting for ``what`` is an error."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.end

    def error(self, detail: str = "") -> TransportTimeout:
        """The error to raise when the deadline passed."""
        extra = f" ({detail})" if detail else ""
        return TransportTimeout(
            f"timed out after {self.timeout_s:g} s waiting for {self.what}{extra}; "
            "raise timeout_s if the peer is just slow, otherwise check that it is alive"
        )

    def check(self, detail: str = "") -> None:
        """Raise :class:`TransportTimeout` if the deadline passed."""
        if self.expired():
            raise self.error(detail)


def poll_until(
    ready: Callable[[], bool],
    deadline: Deadline,
    *,
    interval_s: float = 0.0005,
    max_interval_s: float = 0.01,
) -> None:
    """Call ``ready`` until it returns True, backing off up to ``max_interval_s`` between calls;
    raise :class:`TransportTimeout` when ``deadline`` passes first."""
    delay = interval_s
    while not ready():
        deadline.check()
        time.sleep(delay)
        delay = min(max_interval_s, delay * 2)
