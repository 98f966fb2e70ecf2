"""Health-checks the engines of a router and restarts a dead or hung one.

An engine is dead when its process exited, or when ``/health`` failed (error, no connection or
no answer within ``health_timeout_s``) ``failures_to_dead`` times in a row. A dead engine is
taken out of the router first, so requests in flight on it fail at once with
:class:`~miles_engine_client.router.EngineUnavailable`; then its old process is killed, a new
one is launched, it receives the current weights through ``resync`` and must report the
current weight version before it is put back. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles_engine_client.client import EngineClient
from miles_engine_client.router import EngineRouter

log = logging.getLogger(__name__)

Launch = Callable[[int], str | Awaitable[str]]
Resync = Callable[[EngineClient], Awaitable[None]]
ProcessOf = Callable[[int], "subprocess.Popen[bytes] | int | None"]


class EngineRestartError(RuntimeError):
    """A restart step failed (kill, launch, resync or the version check)."""


@dataclass
class _Slot:
    """What the supervisor knows about one engine slot."""

    consecutive_failures: int = 0
    restarts: int = 0
    restart_failures: int = 0
    restarting: bool = False
    gave_up: bool = False
    last_error: str = ""


class EngineSupervisor:
    """Watches every engine of ``router`` and restarts the ones that die or hang.

    Args:
        router: the router whose slots are supervised (slot ``i`` is engine ``i``).
        launch: ``launch(index) -> url`` (sync, run in a thread, or async) starting engine
            ``index`` and returning its base URL once it answers ``/health``.
        resync: ``await resync(client)`` gives a restarted engine the current weights (e.g.
            ``client.update_weights_from_disk(path, weight_version=v)``); None when the
            launched engine already serves the current weights.
        current_version: ``current_version() -> str | None``, the weight version every engine
            must report; a restarted engine reporting another one is not put back. None (or
            a None answer) skips the check.
        process: ``process(index) -> Popen | pid | None``, the engine's process, to notice an
            exit without waiting for health checks and to kill a hung one before relaunching.
        client_factory: builds the client of a restarted engine from its URL.
        interval_s: time between two rounds of checks.
        health_timeout_s: bound on one ``/health`` call.
        failures_to_dead: consecutive failed checks that make an engine dead.
        deep_health: use ``/health_generate`` (one token end to end) instead of ``/health``.
        kill_timeout_s: bound on waiting for a killed process to exit.
        launch_timeout_s / resync_timeout_s: bounds on a launch and on ``resync`` plus the
            version check.
        max_restart_attempts: tries per restart before the slot is left out (``gave_up``).
        restart_backoff_s: pause between two tries.
    """

    def __init__(
        self,
        router: EngineRouter,
        launch: Launch,
        *,
        resync: Resync | None = None,
        current_version: Callable[[], str | None] | None = None,
        process: ProcessOf | None = None,
        client_factory: Callable[[str], EngineClient] = EngineClient,
        interval_s: float = 2.0,
        health_timeout_s: float = 5.0,
        failures_to_dead: int = 3,
        deep_health: bool = False,
        kill_timeout_s: float = 10.0,
        launch_timeout_s: float = 300.0,
        resync_timeout_s: float = 300.0,
        max_restart_attempts: int = 3,
        restart_backoff_s: float = 1.0,
    ) -> None:
        if failures_to_dead < 1:
            raise ValueError("failures_to_dead must be >= 1")
        if interval_s <= 0 or health_timeout_s <= 0:
            raise ValueError("interval_s and health_timeout_s must be > 0")
        self.router = router
        self.launch = launch
        self.resync = resync
        self.current_version = current_version
        self.process = process
        self.client_factory = client_factory
        self.interval_s = interval_s
        self.health_timeout_s = health_timeout_s
        self.failures_to_dead = failures_to_dead
        self.deep_health = deep_health
        self.kill_timeout_s = kill_timeout_s
        self.launch_timeout_s = launch_timeout_s
        self.resync_timeout_s = resync_timeout_s
        self.max_restart_attempts = max_restart_attempts
        self.restart_backoff_s = restart_backoff_s
        self._slots: dict[int, _Slot] = {i: _Slot() for i in router.indices}
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._restarted = asyncio.Event()
        router.on_failure(self._on_router_failure)

    # --- lifecycle ----------------------------------------------------------------------------

    def watch(self, index: int) -> None:
        """Supervise slot ``index`` too (an engine added to the router after construction)."""
        self._slots.setdefault(index, _Slot())

    def unwatch(self, index: int) -> None:
        """Stop supervising slot ``index`` (e.g. before removing it from the router on
        purpose; a supervised slot missing from the router is restarted)."""
        self._slots.pop(index, None)

    async def start(self) -> None:
        """Start the background checks."""
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.create_task(self._run(), name="engine-supervisor")

    async def stop(self) -> None:
        """Stop checking and cancel restarts in progress."""
        tasks = [t for t in [self._monitor, *self._restarts.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._monitor = None
        self._restarts.clear()

    async def __aenter__(self) -> EngineSupervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _on_router_failure(self, index: int, reason: str) -> None:
        # A dropped connection is a strong hint: check now rather than at the next tick.
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug in one round must not end supervision
                log.exception("engine supervisor round failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval_s)
            self._wake.clear()

    # --- checks -------------------------------------------------------------------------------

    async def check_once(self) -> None:
        """One round: check every supervised slot not already restarting (concurrently) and
        start a restart for each one found dead."""
        todo = [i for i, s in self._slots.items() if not s.restarting and not s.gave_up]
        verdicts = await asyncio.gather(*(self._check(i) for i in todo))
        for index, dead_reason in zip(todo, verdicts, strict=True):
            if dead_reason is not None and index in self._slots:
                self._begin_restart(index, dead_reason)

    async def _check(self, index: int) -> str | None:
        """None when slot ``index`` is alive (or not yet dead), else why it is dead."""
        slot = self._slots.get(index)
        if slot is None:
            return None
        exited = self._exit_code(index)
        if exited is not None:
            return f"process exited with code {exited}"
        try:
            client = self.router.client(index)
        except KeyError:
            # Taken out of the router by someone else while not restarting: bring it back.
            return "not in the router"
        probe = client.health_generate() if self.deep_health else client.health()
        try:
            ok = await asyncio.wait_for(probe, timeout=self.health_timeout_s)
            why = "" if ok else "/health answered an error or refused the connection"
        except asyncio.TimeoutError:
            ok, why = False, f"/health gave no answer within {self.health_timeout_s}s"
        except Exception as exc:  # any other failure of the probe counts as a failed check
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        if ok:
            slot.consecutive_failures = 0
            return None
        slot.consecutive_failures += 1
        slot.last_error = why
        log.warning(
            "engine %d at %s: %s (%d/%d)",
            index,
            client.base_url,
            why,
            slot.consecutive_failures,
            self.failures_to_dead,
        )
        if slot.consecutive_failures >= self.failures_to_dead:
            return f"{why} ({slot.consecutive_failures} checks in a row)"
        return None

    def _proc(self, index: int) -> subprocess.Popen[bytes] | int | None:
        return self.process(index) if self.process is not None else None

    def _exit_code(self, index: int) -> int | None:
        """The exit code when the watched process has exited, else None."""
        proc = self._proc(index)
        if proc is None:
            return None
        if isinstance(proc, subprocess.Popen):
            return proc.poll()
        return _pid_exit_code(proc)

    # --- restarts -----------------------------------------------------------------------------

    def _begin_restart(self, index: int, reason: str) -> None:
        slot = self._slots[index]
        slot.restarting = True
        slot.last_error = reason
        # Out of the router first: requests in flight fail now, new ones go elsewhere.
        old = self.router.remove(index, f"engine declared dead by the supervisor: {reason}")
        log.error("engine %d is dead (%s); restarting", index, reason)
        self._restarts[index] = asyncio.create_task(
            self._restart(index, reason, old), name=f"engine-restart-{index}"
        )

    async def restart(self, index: int, reason: str = "restart requested") -> None:
        """Restart slot ``index`` now and wait for the outcome (raises
        :class:`EngineRestartError` when every try failed)."""
        self.watch(index)
        if not self._slots[index].restarting:
            self._begin_restart(index, reason)
        await self._restarts[index]
        if self._slots[index].gave_up:
            raise EngineRestartError(f"engine {index}: {self._slots[index].last_error}")

    async def _restart(self, index: int, reason: str, old: EngineClient | None) -> None:
        slot = self._slots[index]
        try:
            if old is not None:
                await old.close()
            for attempt in range(1, self.max_restart_attempts + 1):
                try:
                    client = await self._relaunch(index)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    slot.restart_failures += 1
                    slot.last_error = f"restart try {attempt} failed: {type(exc).__name__}: {exc}"
                    log.error("engine %d: %s", index, slot.last_error)
                    await asyncio.sleep(self.restart_backoff_s * attempt)
                    continue
                self.router.add(client, index=index)
                slot.restarts += 1
                slot.consecutive_failures = 0
                log.warning("engine %d restarted at %s (%s)", index, client.base_url, reason)
                return
            slot.gave_up = True
            log.error(
                "engine %d left out after %d failed restarts", index, self.max_restart_attempts
            )
        finally:
            slot.restarting = False
            self._restarts.pop(index, None)
            self._restarted.set()

    async def _relaunch(self, index: int) -> EngineClient:
        """Kill the old process, launch a new one, resync it and check its version."""
        await self._kill(index)
        started = time.monotonic()
        # A blocking launcher (it polls /health itself) runs in a thread so checks of the
        # other engines and the failing of requests go on meanwhile.
        if inspect.iscoroutinefunction(self.launch):
            pending: Awaitable[str | Awaitable[str]] = self.launch(index)  # type: ignore[assignment]
        else:
            pending = asyncio.to_thread(self.launch, index)
        url = await asyncio.wait_for(pending, timeout=self.launch_timeout_s)
        if inspect.isawaitable(url):
            url = await asyncio.wait_for(url, timeout=self.launch_timeout_s)
        if not isinstance(url, str):
            raise EngineRestartError(f"launch({index}) returned {url!r}, not a URL")
        client = self.client_factory(url)
        try:
            await asyncio.wait_for(self._resync(index, client), timeout=self.resync_timeout_s)
        except BaseException:
            await client.close()
            raise
        log.info("engine %d relaunched in %.1fs", index, time.monotonic() - started)
        return client

    async def _resync(self, index: int, client: EngineClient) -> None:
        if self.resync is not None:
            await self.resync(client)
        expected = self.current_version() if self.current_version is not None else None
        if expected is not None:
            got = await client.get_weight_version()
            if got != expected:
                raise EngineRestartError(
                    f"engine {index} at {client.base_url} reports weight version {got!r} "
                    f"after resync, expected {expected!r}"
                )

    async def _kill(self, index: int) -> None:
        """SIGKILL the old process (its process group when it leads one) and wait for it."""
        proc = self._proc(index)
        if proc is None:
            return
        pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
        if self._exit_code(index) is None:
            _kill_tree(pid)
        deadline = time.monotonic() + self.kill_timeout_s
        while self._exit_code(index) is None:
            if time.monotonic() > deadline:
                raise EngineRestartError(
                    f"engine {index} (pid {pid}) did not exit within {self.kill_timeout_s}s"
                )
            await asyncio.sleep(0.05)

    async def wait_for_restarts(self, count: int, timeout_s: float) -> None:
        """Wait until ``restarts_total >= count`` and no restart is in progress (TimeoutError
        after ``timeout_s``)."""

        async def until() -> None:
            while self.restarts_total < count or self._restarts:
                self._restarted.clear()
                await self._restarted.wait()

        await asyncio.wait_for(until(), timeout=timeout_s)

    # --- metrics ------------------------------------------------------------------------------

    @property
    def restarts_total(self) -> int:
        """Successful restarts over all slots."""
        return sum(s.restarts for s in self._slots.values())

    def status(self, index: int) -> dict[str, object]:
        """Slot ``index``'s state: restarts, failures, whether it is restarting, last error."""
        s = self._slots[index]
        return {
            "restarts": s.restarts,
            "restart_failures": s.restart_failures,
            "consecutive_failures": s.consecutive_failures,
            "restarting": s.restarting,
            "gave_up": s.gave_up,
            "last_error": s.last_error,
        }

    def metrics(self) -> dict[str, float]:
        """``supervisor/restarts_total``, ``supervisor/restart_failures_total``,
        ``supervisor/engines_down`` and per slot ``supervisor/engine/<i>/restarts``."""
        out: dict[str, float] = {
            "supervisor/restarts_total": float(self.restarts_total),
            "supervisor/restart_failures_total": float(
                sum(s.restart_failures for s in self._slots.values())
            ),
            "supervisor/engines_down": float(
                sum(1 for s in self._slots.values() if s.restarting or s.gave_up)
            ),
        }
        for i, s in sorted(self._slots.items()):
            out[f"supervisor/engine/{i}/restarts"] = float(s.restarts)
        return out


def _pid_exit_code(pid: int) -> int | None:
    """Exit code of ``pid`` if it has exited (reaping it when it is our child), else None;
    -1 when it is gone but not ours to reap."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            return None
        return None
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group when ``pid`` leads its own group (an engine started in
    a new session, with helper processes), else ``pid`` alone: never our own group."""
    with contextlib.suppress(ProcessLookupError):
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgrp():
            os.killpg(pgid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
