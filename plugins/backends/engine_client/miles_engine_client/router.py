"""Least-busy routing of generate requests over several engines.

:class:`EngineRouter` has the same ``generate`` signature as :class:`EngineClient`, so a rollout
function takes either. Each request goes to the engine with the fewest requests in flight (ties
broken round-robin). A request in flight on an engine that is removed, replaced or whose
connection drops fails at once with :class:`EngineUnavailable` naming the engine, so the caller
can record its group as aborted instead of waiting on a dead server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from miles_engine_client.client import EngineClient, GenerateResult

T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine a request was on (or would go to) cannot serve it.

    Attributes:
        url: the engine's base URL (empty when no engine was available at all).
        index: the router slot of the engine, if known.
        reason: why (removed by the supervisor, connection lost, ...).
    """

    def __init__(self, url: str, reason: str, *, index: int | None = None) -> None:
        where = f"engine {index} at {url}" if index is not None else f"engine at {url}"
        super().__init__(f"{where} unavailable: {reason}" if url else reason)
        self.url = url
        self.index = index
        self.reason = reason


class NoEngineAvailable(EngineUnavailable):
    """No engine was in the router within the wait timeout."""

    def __init__(self, waited_s: float) -> None:
        super().__init__("", f"no engine in the router after waiting {waited_s:.1f}s")


class EngineBroadcastError(RuntimeError):
    """A broadcast reached every engine but failed on some; ``errors`` maps slot -> error."""

    def __init__(self, op: str, errors: Mapping[int, BaseException]) -> None:
        detail = "; ".join(f"engine {i}: {type(e).__name__}: {e}" for i, e in errors.items())
        super().__init__(f"{op} failed on {len(errors)} engine(s): {detail}")
        self.op = op
        self.errors = dict(errors)


@dataclass
class _Engine:
    """One router slot: a client plus its bookkeeping (loop-local, no locking needed)."""

    index: int
    client: EngineClient
    in_flight: int = 0
    requests_total: int = 0
    failures_total: int = 0
    # Set when the slot is taken out; every request waiting on this engine watches it.
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    @property
    def url(self) -> str:
        return self.client.base_url


FailureListener = Callable[[int, str], None]


class EngineRouter:
    """Sends each ``generate`` to the least busy of several :class:`EngineClient` s.

    Args:
        clients: the initial engines, in slot order (slot ``i`` is ``clients[i]``).
        engine_wait_s: how long a request waits for an engine when the router has none
            (e.g. while the only engine restarts) before :class:`NoEngineAvailable`.
        request_timeout_s: optional bound on one generate; None leaves it to the client (a
            hung engine is taken out by the supervisor, which fails its requests).
        control_timeout_s: bound on each broadcast (pause, continue, flush, version, weights).

    All methods must be called from one event loop. Slots are stable integers: the supervisor
    replaces the client of slot ``i`` when engine ``i`` restarts, and metrics are keyed by slot.
    """

    def __init__(
        self,
        clients: Sequence[EngineClient] = (),
        *,
        engine_wait_s: float = 120.0,
        request_timeout_s: float | None = None,
        control_timeout_s: float = 120.0,
    ) -> None:
        self.engine_wait_s = engine_wait_s
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self._engines: dict[int, _Engine] = {}
        self._rr = 0
        self._rids: dict[str, _Engine] = {}
        self._changed = asyncio.Event()
        self._listeners: list[FailureListener] = []
        # Entries taken out, kept so per-slot totals survive restarts.
        self._retired: dict[int, list[_Engine]] = {}
        for i, c in enumerate(clients):
            self.add(c, index=i)

    # --- membership ---------------------------------------------------------------------------

    @property
    def indices(self) -> list[int]:
        """The slots currently serving, in order."""
        return sorted(self._engines)

    def client(self, index: int) -> EngineClient:
        """The client in slot ``index`` (KeyError when the slot is empty)."""
        return self._engines[index].client

    def clients(self) -> dict[int, EngineClient]:
        """Slot -> client for every engine currently serving."""
        return {i: self._engines[i].client for i in self.indices}

    def add(self, client: EngineClient, *, index: int | None = None) -> int:
        """Put ``client`` into slot ``index`` (the next free slot when None); returns the slot.
        Raises ValueError when the slot is taken (use :meth:`replace`)."""
        if index is None:
            # Never reuse a retired slot implicitly: its totals belong to the old engine line.
            index = max([*self._engines, *self._retired], default=-1) + 1
        if index in self._engines:
            raise ValueError(f"engine slot {index} is taken by {self._engines[index].url}")
        self._engines[index] = _Engine(index=index, client=client)
        self._changed.set()
        return index

    def remove(self, index: int, reason: str = "removed from the router") -> EngineClient | None:
        """Take slot ``index`` out: new requests go elsewhere, and every request in flight on
        it fails at once with :class:`EngineUnavailable`. Returns the client (not closed), or
        None when the slot was empty."""
        entry = self._engines.pop(index, None)
        if entry is None:
            return None
        entry.reason = reason
        entry.dead.set()
        self._retired.setdefault(index, []).append(entry)
        for rid in [r for r, e in self._rids.items() if e is entry]:
            del self._rids[rid]
        return entry.client

    def replace(
        self, index: int, client: EngineClient, reason: str = "replaced"
    ) -> EngineClient | None:
        """Swap the client of slot ``index`` (failing requests in flight on the old one);
        returns the old client, not closed."""
        old = self.remove(index, reason)
        self.add(client, index=index)
        return old

    def on_failure(self, listener: FailureListener) -> None:
        """Call ``listener(index, reason)`` when a request sees an engine's connection drop
        (the supervisor uses it to check that engine at once instead of at the next tick)."""
        self._listeners.append(listener)

    async def close(self) -> None:
        """Close every client's HTTP session."""
        for entry in list(self._engines.values()):
            await entry.client.close()

    async def __aenter__(self) -> EngineRouter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- routing ------------------------------------------------------------------------------

    def _pick(self) -> _Engine | None:
        """Fewest in flight; among equals the first at or after the round-robin cursor."""
        order = self.indices
        if not order:
            return None
        n = len(order)
        start = self._rr % n
        rotated = order[start:] + order[:start]
        best = min(rotated, key=lambda i: self._engines[i].in_flight)
        self._rr = order.index(best) + 1
        return self._engines[best]

    async def _acquire(self) -> _Engine:
        deadline = time.monotonic() + self.engine_wait_s
        while True:
            entry = self._pick()
            if entry is not None:
                return entry
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoEngineAvailable(self.engine_wait_s)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                raise NoEngineAvailable(self.engine_wait_s) from None

    async def _on_engine(
        self, entry: _Engine, make: Callable[[EngineClient], Awaitable[T]], timeout: float | None
    ) -> T:
        """Run ``make(client)`` on ``entry`` and fail fast when the slot is taken out."""
        work = asyncio.ensure_future(make(entry.client))
        dead = asyncio.ensure_future(entry.dead.wait())
        try:
            done, _ = await asyncio.wait(
                {work, dead}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if work in done:
                try:
                    return work.result()
                except aiohttp.ClientConnectionError as exc:
                    reason = f"connection lost: {type(exc).__name__}: {exc}"
                    entry.failures_total += 1
                    for listener in self._listeners:
                        listener(entry.index, reason)
                    raise EngineUnavailable(entry.url, reason, index=entry.index) from exc
            if dead in done:
                entry.failures_total += 1
                raise EngineUnavailable(entry.url, entry.reason, index=entry.index)
            entry.failures_total += 1
            raise EngineUnavailable(entry.url, f"no answer within {timeout}s", index=entry.index)
        finally:
            for t in (work, dead):
                if not t.done():
                    t.cancel()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> GenerateResult:
        """``POST /generate`` on the least busy engine (same signature as
        :meth:`EngineClient.generate`). Raises :class:`EngineUnavailable` (naming the engine)
        when that engine is taken out or its connection drops while the request runs."""
        entry = await self._acquire()
        entry.in_flight += 1
        entry.requests_total += 1
        if rid is not None:
            self._rids[rid] = entry
        try:
            return await self._on_engine(
                entry,
                lambda c: c.generate(
                    input_ids, sampling_params, return_logprob=return_logprob, rid=rid
                ),
                self.request_timeout_s,
            )
        finally:
            entry.in_flight -= 1
            if rid is not None and self._rids.get(rid) is entry:
                del self._rids[rid]

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort ``rid`` on the engine running it (every engine when unknown or
        ``abort_all``)."""
        entry = None if abort_all else self._rids.get(rid)
        if entry is not None:
            await asyncio.wait_for(entry.client.abort_request(rid), timeout=self.control_timeout_s)
            return
        await self._broadcast("abort_request", lambda c: c.abort_request(rid, abort_all=abort_all))

    # --- broadcasts ---------------------------------------------------------------------------

    async def _broadcast(
        self, op: str, make: Callable[[EngineClient], Awaitable[T]]
    ) -> dict[int, T]:
        """Run ``make`` on every engine concurrently, each bounded by ``control_timeout_s``;
        raises :class:`EngineBroadcastError` after all finished if any failed."""
        entries = [self._engines[i] for i in self.indices]

        async def one(e: _Engine) -> T:
            return await asyncio.wait_for(make(e.client), timeout=self.control_timeout_s)

        results = await asyncio.gather(*(one(e) for e in entries), return_exceptions=True)
        pairs = list(zip(entries, results, strict=True))
        errors = {e.index: r for e, r in pairs if isinstance(r, BaseException)}
        if errors:
            raise EngineBroadcastError(op, errors)
        return {e.index: r for e, r in pairs}  # type: ignore[misc]

    async def pause_generation(self, mode: str = "abort") -> dict[int, Any]:
        """``/pause_generation`` on every engine; slot -> answer."""
        return await self._broadcast("pause_generation", lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> dict[int, Any]:
        """``/continue_generation`` on every engine; slot -> answer."""
        return await self._broadcast("continue_generation", lambda c: c.continue_generation())

    async def flush_cache(self) -> bool:
        """``/flush_cache`` on every engine; True only when every engine flushed."""
        results = await self._broadcast("flush_cache", lambda c: c.flush_cache())
        return all(results.values())

    async def get_weight_version(self) -> dict[int, str | None]:
        """Slot -> the weight version each engine reports (``None``: it reports none)."""
        return await self._broadcast("get_weight_version", lambda c: c.get_weight_version())

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[int, dict[str, Any]]:
        """``/update_weights_from_disk`` on every engine; slot -> answer."""
        return await self._broadcast(
            "update_weights_from_disk",
            lambda c: c.update_weights_from_disk(
                model_path,
                weight_version=weight_version,
                abort_all_requests=abort_all_requests,
                flush_cache=flush_cache,
            ),
        )

    async def health(self) -> dict[int, bool]:
        """Slot -> ``/health`` of each engine (False on a timeout)."""

        async def one(c: EngineClient) -> bool:
            try:
                return await asyncio.wait_for(c.health(), timeout=self.control_timeout_s)
            except asyncio.TimeoutError:
                return False

        return await self._broadcast("health", one)

    # --- metrics ------------------------------------------------------------------------------

    def in_flight(self) -> dict[int, int]:
        """Slot -> requests in flight now."""
        return {i: self._engines[i].in_flight for i in self.indices}

    def _lines(self) -> dict[int, list[_Engine]]:
        """Slot -> every entry it has had (retired ones first), for totals across restarts."""
        lines = {i: list(v) for i, v in self._retired.items()}
        for i, e in self._engines.items():
            lines.setdefault(i, []).append(e)
        return dict(sorted(lines.items()))

    def requests_total(self) -> dict[int, int]:
        """Slot -> requests sent since the router started (kept across restarts)."""
        return {i: sum(e.requests_total for e in es) for i, es in self._lines().items()}

    def metrics(self) -> dict[str, float]:
        """``router/engines``, ``router/in_flight`` and per slot ``engine/<i>/in_flight``,
        ``engine/<i>/requests_total``, ``engine/<i>/failures_total`` (requests that ended
        with :class:`EngineUnavailable`, kept across restarts)."""
        out: dict[str, float] = {
            "router/engines": float(len(self._engines)),
            "router/in_flight": float(sum(e.in_flight for e in self._engines.values())),
        }
        for i, es in self._lines().items():
            live = self._engines.get(i)
            out[f"engine/{i}/in_flight"] = float(live.in_flight if live else 0)
            out[f"engine/{i}/requests_total"] = float(sum(e.requests_total for e in es))
            out[f"engine/{i}/failures_total"] = float(sum(e.failures_total for e in es))
        return out
