"""The run's I/O thread: an event loop on which the engine fleet and the schedule live, so an
asynchronous schedule keeps generating while the trainer trains in the main thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class IOThread:
    """An event loop in a thread of its own; the parts that live on it take it and call it
    with their coroutines, so the loop over the steps never sees it."""

    #: seconds to wait for the thread to end when the run closes
    JOIN_TIMEOUT_S = 30.0

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="miles-io", daemon=True)

    def start(self) -> None:
        """Start the thread's event loop."""
        self._thread.start()

    def __call__(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the I/O thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop the event loop, wait for the thread, close the loop."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join(timeout=self.JOIN_TIMEOUT_S)
        self._loop.close()
