"""The engine's thread and its inbox: submitted requests and control commands wait in the
inbox, and the thread takes them between two steps, so nothing races a forward pass."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from miles_core.invariant.kernels import invariant_mode
from miles_engine_embedded.request import EngineError

if TYPE_CHECKING:
    from miles_engine_embedded.engine import Engine


class SchedulerThread:
    """Runs ``engine``'s loop: every iteration applies the inbox (requests are enqueued,
    commands run as ``fn(engine)`` with their result set on their future), then runs one
    :meth:`Engine.step` when there is work; it sleeps while there is none."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: list[tuple[str, Any, Any]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        """Start the loop on a thread of its own."""
        self._thread.start()

    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """Run the loop on the calling thread until :meth:`stop`; ``on_start`` is called once
        this thread counts as the loop's (``alive``)."""
        self._thread = threading.current_thread()
        if on_start is not None:
            on_start()
        self._loop()

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the loop (after the current step) and wait for its thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def post(self, *items: tuple[str, Any]) -> None:
        """Put ``(kind, item)`` pairs in the inbox at once (``request`` or ``command``)."""
        with self._cv:
            if self._stop:
                raise EngineError("engine is shutting down", 503)
            self._inbox.extend((kind, item, None) for kind, item in items)
            self._cv.notify()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        with invariant_mode(self.engine.invariant):
            self._run()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not self._stop and not engine.can_run():
                    self._cv.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
            for kind, item, _ in inbox:
                if kind == "request":
                    engine.enqueue(item)
                else:
                    fn, fut = item
                    if not fut.set_running_or_notify_cancel():
                        continue
                    try:
                        fut.set_result(fn(engine))
                    except BaseException as exc:
                        fut.set_exception(exc)
            if engine.can_run():
                engine.step()
        engine.abort(None, message="engine shut down")
