"""The fully asynchronous RL loop: the engines generate continuously into the bounded
:class:`~miles_core.buffer.GroupBuffer`; the trainer takes ``rollout.groups_per_step`` groups
from it, trains, and streams its weights to the engines, which pause only for the update.

**Producer.** Every engine keeps up to ``N`` trajectories in flight (``N``: the engine's
``max_running_requests`` when its options have one, else the server's, else the loop's
``in_flight_per_engine``, by default ``groups_per_step x group_size``). A group is started on
the least loaded engine as soon as that engine has a free trajectory slot, so when one
trajectory ends the next one starts at once (the rest of a new group waits for slots of its
own). Each finished group is judged at arrival (an aborted or failed sample, the sample and
group filters: the synchronous loop's rules) and put in the buffer. A full buffer blocks the
producer (back-pressure): no group starts, finished groups wait for room, and nothing is ever
dropped for lack of room.

**Trainer.** Each step takes ``groups_per_step`` groups; a group whose staleness (trainer
version minus the oldest weight version of any of its tokens) exceeds ``buffer.max_staleness``
is dropped at removal (reason ``stale``); with ``buffer.on_drop: retry`` the prompt of any
dropped group is generated again. The train step, with the ``before_train_step`` and
``after_train_step`` hooks, runs on a worker thread, so a slow trainer never stalls the
producer.

**Weight update.** After each step generation pauses, the weights stream through the
transport, and generation resumes. Two pause modes:

* ``retract``: in-flight requests are aborted (the engine's ``abort`` pause) and, after the
  update, continued from the tokens they had (prompt + partial response, with what is left of
  ``max_new_tokens``): their first tokens carry the old version, the rest the new one, exactly.
* ``freeze``: in-flight requests stay in place (the engine's ``in_place`` pause) and continue
  with the new weights. The engine reports one version per request (the one it finished
  with), so every token of a request that spanned an update is stamped with the version the
  request started with: the oldest version that may have produced any of its tokens. That
  keeps each group's oldest version, hence its staleness, exact or pessimistic, never
  optimistic.

**Ledger.** A group is ``in_flight`` from its start, then ``buffered``, then ``trained`` or
``dropped`` with a reason; the ledger is checked after every step and its counts are metrics.
Groups still in flight or queued when the run ends are dropped as ``run_ended``; those a
checkpoint recorded in flight or queued are dropped as ``interrupted`` on resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import statistics
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from miles_core.buffer import GroupBuffer
from miles_core.config import RunConfig
from miles_core.data import Group
from miles_core.errors import MilesUserError
from miles_core.ledger import BUFFERED, DROP_ABORTED, DROP_FAILED, IN_FLIGHT
from miles_core.loop import SyncLoop, group_metrics
from miles_core.plugins import Plugins

PauseMode = Literal["retract", "freeze"]
#: Reasons of the drops only this loop makes.
DROP_RUN_ENDED = "run_ended"
DROP_INTERRUPTED = "interrupted"

# The engine's pause mode for each of the loop's.
_ENGINE_PAUSE = {"retract": "abort", "freeze": "in_place"}


class EngineSlots:
    """One engine as the producer sees it: at most ``capacity`` trajectories run on it at once,
    new requests wait while generation is paused for a weight update, requests retracted by a
    pause are continued after it, and every generated token's weight version is recorded.

    ``version`` is the engine's weight version; the loop sets it after each update.
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
        #: the engine stopped answering: no request goes to it until it is restarted and has
        #: the current weights (``restarted``: its new server is up, waiting for them)
        self.down = False
        self.restarted = False
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
    ) -> Any:
        """One generation in a trajectory slot of this engine. The result is the client's,
        with ``weight_version`` set to the oldest version of its tokens; ``record`` (when
        given) receives (token ids, log-probs, per-token versions)."""
        self.pending += 1
        try:
            async with self._slots:
                return await self._generate(
                    list(input_ids), dict(sampling_params or {}), return_logprob, rid, record
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
    ) -> Any:
        budget = params.get("max_new_tokens")
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
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
                    prompt + ids, part, return_logprob=return_logprob, rid=request_id
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
        if record is not None:
            record.append((tuple(ids), tuple(logprobs), versions))
        return final

    def __getattr__(self, name: str) -> Any:
        client = self.__dict__.get("client")
        if name.startswith("_") or client is None:
            raise AttributeError(name)
        return getattr(client, name)


class _GroupEngine:
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

    def release(self) -> None:
        """The group ended: whatever it did not start no longer counts on the engine."""
        self.slots.reserved -= self.unstarted
        self.unstarted = 0

    def __getattr__(self, name: str) -> Any:
        slots = self.__dict__.get("slots")
        if name.startswith("_") or slots is None:
            raise AttributeError(name)
        return getattr(slots.client, name)


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


class AsyncLoop(SyncLoop):
    """Runs a fully asynchronous RL job (``run.mode: async``); see the module docstring. Set-up,
    checkpoints, evaluation, metrics and the end of the run are the synchronous loop's.

    ``pause_mode`` (``retract`` or ``freeze``) defaults to ``buffer.pause_mode`` when the config
    has one, else ``retract``; ``in_flight_per_engine`` overrides the engines' capacity.
    """

    def __init__(
        self,
        config: RunConfig,
        plugins: Plugins,
        *,
        resume: bool = False,
        progress: Literal["auto", "on", "off"] = "auto",
        pause_mode: PauseMode | None = None,
        in_flight_per_engine: int | None = None,
    ) -> None:
        super().__init__(config, plugins, resume=resume, progress=progress)
        mode = pause_mode or config.buffer.pause_mode
        if mode not in _ENGINE_PAUSE:
            raise MilesUserError(f"pause mode {mode!r} is not one of retract, freeze")
        self.pause_mode: PauseMode = mode
        if in_flight_per_engine is not None and in_flight_per_engine < 1:
            raise MilesUserError("in_flight_per_engine must be at least 1")
        self.in_flight_per_engine = in_flight_per_engine
        self.buffer: GroupBuffer | None = None
        self.engines: list[EngineSlots] = []
        self._producer: asyncio.Task[None] | None = None
        self._groups: dict[asyncio.Task[None], int] = {}  # in-flight group tasks -> group id
        self._wake: asyncio.Event | None = None
        self._failed: asyncio.Future[None] | None = None
        self._stopped = False
        self._failure_raised = False
        self._exhausted = False
        self._blocked_s = 0.0
        self._blocked_since: float | None = None
        self._window_t0 = time.perf_counter()
        self._watcher: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._restarted: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        # the engines (their clients) the current weight sender was built for
        self._sender_for: tuple[int, ...] = ()

    # --- resume -----------------------------------------------------------------------------

    def _restore(self, path: Path) -> None:
        super()._restore(path)
        # The checkpoint's in-flight and queued groups died with the process that held them.
        for gid, state in self.ledger.state_dict()["state"].items():
            if state in (IN_FLIGHT, BUFFERED):
                self.ledger.drop(int(gid), DROP_INTERRUPTED)

    # --- the producer -----------------------------------------------------------------------

    async def _capacity(self, client: Any) -> int:
        if self.in_flight_per_engine is not None:
            return self.in_flight_per_engine
        n = getattr(self.config.engine.options, "max_running_requests", None)
        if not n:
            try:
                n = (await client.get_server_info()).get("max_running_requests")
            except Exception:  # an engine without the endpoint: the default below
                n = None
        r = self.config.rollout
        return int(n) if n else r.groups_per_step * r.group_size

    async def _engine_version(self, client: Any) -> int:
        try:
            return int(await client.get_weight_version())
        except Exception:  # no endpoint or a non-numeric version: the loop's own
            return self.version

    async def _start_producer(self) -> None:
        if self._producer is not None:
            return
        b = self.config.buffer
        self.buffer = GroupBuffer(
            b.capacity, b.max_staleness, self.ledger, retry_dropped=b.on_drop == "retry"
        )
        self._wake = asyncio.Event()
        self._restarted = asyncio.Event()
        self._update_lock = asyncio.Lock()
        self._failed = asyncio.get_running_loop().create_future()
        self._sender_for = tuple(id(c) for c in self.clients)
        for client in self.clients:
            slots = EngineSlots(
                client, await self._capacity(client), await self._engine_version(client)
            )
            slots.on_change = self._wake.set
            self.engines.append(slots)
        self._window_t0 = time.perf_counter()
        self._producer = asyncio.get_running_loop().create_task(self._produce())
        self._producer.add_done_callback(self._task_done)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        self._watcher.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        gid = self._groups.pop(task, None)
        if self._wake is not None:
            self._wake.set()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        # A bug in a rollout function (or in the producer): the run fails, as the synchronous
        # loop does, at the trainer's next wait or when the producer stops.
        if gid is not None and self.ledger.state(gid) == IN_FLIGHT:
            self.ledger.drop(gid, DROP_FAILED)
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    def _next_prompt(self) -> dict[str, Any] | None:
        assert self.buffer is not None and self._prompts is not None
        if self.buffer.retry_prompts:
            return self.buffer.retry_prompts.popleft()
        if self._exhausted:
            return None
        try:
            return next(self._prompts)
        except StopIteration:
            self._exhausted = True
            return None

    def _full(self) -> bool:
        assert self.buffer is not None
        return len(self.buffer) >= self.buffer.capacity

    async def _produce(self) -> None:
        assert self.buffer is not None and self._wake is not None
        loop = asyncio.get_running_loop()
        while not self._stopped:
            while not self._stopped and not self._full():
                live = [s for s in self.engines if not s.down]
                if not live:
                    break  # every engine is restarting: the update after it wakes this loop
                slots = min(live, key=lambda s: s.load / s.capacity)
                if slots.load >= slots.capacity:
                    break
                prompt = self._next_prompt()
                if prompt is None:
                    break
                gid = Group(samples=[]).group_id  # the ledger tracks it from its start
                self.ledger.start(gid)
                # The view reserves the group's trajectories on the engine now, before the
                # task first runs, so the next pass of this loop sees the engine's new load.
                view = _GroupEngine(slots, self.config.rollout.group_size)
                task = loop.create_task(self._run_group(prompt, view, gid))
                self._groups[task] = gid
                task.add_done_callback(self._task_done)
            now = time.perf_counter()
            starved = any(s.load < s.capacity for s in self.engines if not s.down)
            if self._full() and starved:  # back-pressure: engines with room wait for the buffer
                if self._blocked_since is None:
                    self._blocked_since = now
            elif self._blocked_since is not None:
                self._blocked_s += now - self._blocked_since
                self._blocked_since = None
            if self._exhausted and not self._groups and not self.buffer.retry_prompts:
                await self.buffer.close()  # the trainer takes what is left, then stops
                return
            self._wake.clear()
            await self._wake.wait()

    async def _run_group(self, prompt: dict[str, Any], view: _GroupEngine, gid: int) -> None:
        assert self.parts is not None and self.buffer is not None
        try:
            group: Group = await self.parts.rollout(
                prompt,
                group_size=self.config.rollout.group_size,
                engine=view,
                reward=self.parts.reward,
                family=self.parts.family,
                sampling_params=self._sampling_params(),
                step=self.step,
                seed=self.config.run.seed,
            )
        finally:
            view.release()
        group.group_id = gid
        restamp_versions(group, view.records)
        reason = self._arrival_reason(group)
        lost = view.restarts != view.slots.restarts
        if reason == DROP_FAILED and (lost or await self._engine_lost(view.slots)):
            reason = DROP_ABORTED  # its engine died under it: the restart is under way
        if reason is not None:
            self.buffer.drop(group, reason)
        else:
            await self.buffer.put(group)  # waits while the buffer is full: back-pressure

    async def _stop_producer(self) -> None:
        """Stop generating: cancel every group in flight (closing its requests aborts them on
        the engine) and drop it, and every queued group, as ``run_ended``."""
        if self._producer is None or self._stopped:
            return
        self._stopped = True
        for slots in self.engines:
            slots.stopping = True
            slots.open_gate()
        tasks = [self._producer, *self._groups, *([self._watcher] if self._watcher else [])]
        unfinished = dict(self._groups)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A restart under way finishes (its launch cannot be cancelled halfway), so the
        # launcher knows every server it must stop.
        await asyncio.gather(*self._restarts, return_exceptions=True)
        for gid in unfinished.values():
            if self.ledger.state(gid) == IN_FLIGHT:
                self.ledger.drop(gid, DROP_RUN_ENDED)
        if self.buffer is not None:
            self.buffer.clear(DROP_RUN_ENDED)
        self.ledger.check()
        if self._failed is not None and self._failed.done() and not self._failure_raised:
            self._failure_raised = True
            self._failed.result()  # a group failed after the trainer's last wait

    # --- engine failures ----------------------------------------------------------------------

    #: seconds between health checks of the serving engines (an idle engine that died is found
    #: too, not only one that fails a request)
    HEALTH_INTERVAL_S = 5.0

    async def _watch(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.HEALTH_INTERVAL_S)
            live = [s for s in self.engines if not s.down]
            await asyncio.gather(*(self._engine_lost(s) for s in live))

    async def _engine_lost(self, slots: EngineSlots) -> bool:
        """Whether ``slots``' engine is down (a group on it failed): when it stopped answering
        just now, take it out of service and start its restart."""
        if slots.down:
            return True
        alive = await self._alive(slots.client)
        if slots.down:  # found dead meanwhile (another failed group, the watcher)
            return True
        if alive:
            return False
        self._begin_restart(slots)
        return True

    def _begin_restart(self, slots: EngineSlots) -> None:
        slots.restarts += 1
        self.engine_restarts += 1  # counted when it begins, so a checkpoint right after has it
        slots.down = True
        slots.restarted = False
        slots.close_gate(retract=False)
        task = asyncio.get_running_loop().create_task(self._restart(slots))
        self._restarts.add(task)
        task.add_done_callback(self._restart_done)

    def _restart_done(self, task: asyncio.Task[None]) -> None:
        self._restarts.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # an engine that cannot be started again: the run fails at the trainer's next wait
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def _restart(self, slots: EngineSlots) -> None:
        """Stop what is left of the engine's server and start a new one; the other engines
        keep generating meanwhile. The new server gets the weights at the next update (at
        once when no engine is left to generate) and only then serves."""
        assert self.parts is not None and self._restarted is not None
        launcher = self.parts.launcher
        i = self.engines.index(slots)
        self.progress.log(f"engine {i} stopped answering: restarting it")
        close = getattr(slots.client, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
        stop = getattr(launcher, "stop", None)
        if stop is not None:
            await asyncio.to_thread(stop, i)  # whatever is left of it: a hung server, a port
        url = await asyncio.to_thread(launcher.launch, self.model_path, index=i)
        slots.client = self.clients[i] = launcher.client(url)
        slots.version = await self._engine_version(slots.client)
        slots.restarted = True
        self._restarted.set()

    # --- one step ---------------------------------------------------------------------------

    async def _take(self, n: int) -> list[Group]:
        """Wait for ``n`` groups. Meanwhile, when every engine is down and one is back, the
        trainer (idle, its weights still) sends it the weights so generation starts again."""
        assert self.buffer is not None and self._failed is not None
        assert self._restarted is not None
        getter = asyncio.ensure_future(self.buffer.get_batch(n, self.version))
        while True:
            if all(s.down for s in self.engines) and any(s.restarted for s in self.engines):
                await self._update_engines()
            self._restarted.clear()
            restarted = asyncio.ensure_future(self._restarted.wait())
            waiting: set[asyncio.Future[Any]] = {getter, self._failed, restarted}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            restarted.cancel()
            if getter.done():
                return getter.result()
            if self._failed.done():
                break
        getter.cancel()
        self._failure_raised = True
        self._failed.result()  # raises the producer's failure
        raise AssertionError("unreachable")

    def _train(self, groups: list[Group]) -> tuple[dict[str, float], float]:
        """The trainer's side of a step, on a worker thread: hooks around the train step."""
        assert self.parts is not None
        self.hooks.before_train_step(self.step, groups)
        t0 = time.perf_counter()
        metrics: dict[str, float] = self.parts.trainer.train_step(groups, self.parts.algorithm)
        seconds = time.perf_counter() - t0
        self.hooks.after_train_step(self.step, groups, metrics)
        return metrics, seconds

    async def _update_engines(self) -> dict[str, float]:
        """Pause generation, stream the weights, resume (whatever happens). The update reaches
        every serving engine and every restarted one (which then serves); an engine that dies
        during it is taken out and restarted, and the others get the update again."""
        assert self._update_lock is not None
        async with self._update_lock:
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            for _ in range(1 + len(self.engines)):
                live = [s for s in self.engines if not s.down]
                targets = live + [s for s in self.engines if s.down and s.restarted]
                if not targets:
                    break  # every engine is restarting: each gets the weights when it is back
                clients = [s.client for s in targets]
                try:
                    metrics = await self._update(live, targets)
                    break
                except RuntimeError:
                    # An engine that died during the update may already be restarting, or
                    # even back (found by a failed group meanwhile): its client changed.
                    states = await asyncio.gather(*(self._alive(c) for c in clients))
                    lost = False
                    for slots, client, ok in zip(targets, clients, states, strict=True):
                        if slots.client is not client:
                            lost = True
                        elif not ok:
                            lost = True
                            if not slots.down or slots.restarted:
                                self._begin_restart(slots)
                    if not lost:
                        raise
            else:
                raise RuntimeError(f"weight update to version {self.version}: engines kept dying")
            metrics["time/paused_s"] = time.perf_counter() - t0
            return metrics

    async def _update(
        self, live: list[EngineSlots], targets: list[EngineSlots]
    ) -> dict[str, float]:
        """One weight update of ``targets``; the serving ones (``live``) pause around it."""
        assert self.parts is not None and self._wake is not None
        retract = self.pause_mode == "retract"
        for slots in live:
            slots.close_gate(retract=retract)
        try:
            mode = _ENGINE_PAUSE[self.pause_mode]
            paused = await asyncio.gather(
                *(s.client.pause_generation(mode) for s in live), return_exceptions=True
            )
            failed = [s for s, a in zip(live, paused, strict=True) if isinstance(a, BaseException)]
            if failed:
                raise RuntimeError(f"{len(failed)} engine(s) did not pause for the update")
            members = tuple(id(s.client) for s in targets)
            if members != self._sender_for:  # an engine left or came back: a new sender
                self._sender_for = ()
                self.parts.transport = await asyncio.to_thread(self._renew_transport, len(targets))
                self._sender_for = members
            try:
                metrics = await self._sync_weights([s.client for s in targets])
            except RuntimeError:
                self._sender_for = ()  # its connections are broken: renew it next time
                raise
            for slots in targets:
                slots.version = self.version
                if slots.down:  # restarted, and now it has the weights: it serves
                    slots.down = slots.restarted = False
                    slots.open_gate()
        finally:
            answers = await asyncio.gather(
                *(s.client.continue_generation() for s in live), return_exceptions=True
            )
            for slots, answer in zip(live, answers, strict=True):
                if not slots.down:
                    slots.open_gate()
                if isinstance(answer, BaseException) and not slots.down:
                    await self._engine_lost(slots)
            self._wake.set()
        return metrics

    def _window(self) -> dict[str, float]:
        """The producer's side since the previous step: tokens/s, idle, pause, back-pressure."""
        now = time.perf_counter()
        wall = max(now - self._window_t0, 1e-9)
        self._window_t0 = now
        blocked = self._blocked_s
        if self._blocked_since is not None:
            blocked += now - self._blocked_since
            self._blocked_since = now
        self._blocked_s = 0.0
        tokens, busy, paused = 0, [], []
        for slots in self.engines:
            t, b, p = slots.take_window()
            tokens += t
            busy.append(b)
            paused.append(p)
        return {
            "rollout/tokens_per_s": tokens / wall,
            "rollout/idle_fraction": 1.0 - statistics.fmean(busy) / wall if busy else 1.0,
            "rollout/paused_fraction": statistics.fmean(paused) / wall if paused else 0.0,
            "rollout/blocked_fraction": min(blocked / wall, 1.0),
            "rollout/trajectories_in_flight": float(sum(s.pending for s in self.engines)),
            "rollout/groups_in_flight": float(len(self._groups)),
        }

    async def _train_step(self) -> dict[str, float]:
        assert self.parts is not None
        await self._start_producer()
        assert self.buffer is not None and self._wake is not None
        self.step += 1
        t0 = time.perf_counter()
        groups = await self._take(self.config.rollout.groups_per_step)
        self._wake.set()  # the batch left room in the buffer
        wait_s = time.perf_counter() - t0
        if not groups:
            raise MilesUserError(
                f"step {self.step}: no group left to train on ({self.ledger.counts()}); the data "
                "source is exhausted"
            )
        train_metrics, train_s = await asyncio.to_thread(self._train, groups)
        self.version = int(self.parts.trainer.weight_version)
        await self.buffer.prune(self.version)  # queued groups now beyond the bound make room
        self._wake.set()
        sync = await self._update_engines()
        self.hooks.after_weight_sync(self.step, self.version, sync)
        self.ledger.check()
        step_s = time.perf_counter() - t0
        consumed = sum(g.num_generated_tokens for g in groups)
        metrics: dict[str, float] = {
            "time/rollout_s": wait_s,
            "time/train_s": train_s,
            "trainer/wait_s": wait_s,
            "trainer/idle_fraction": wait_s / max(step_s, 1e-9),
            "trainer/tokens_per_s": consumed / max(step_s, 1e-9),
            "trainer/groups": float(len(groups)),
        }
        metrics.update(self._window())
        metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        metrics.update(group_metrics(groups))
        metrics.update(sync)
        metrics.update(self.buffer.metrics(self.version))
        metrics.update({f"ledger/{k}": float(v) for k, v in self.ledger.counts().items()})
        metrics["reward/failure_rate"] = self.reward_failures / max(self.samples_seen, 1)
        metrics["data/skipped_rows"] = float(self.skipped_rows())
        metrics["engine/restarts"] = float(self.engine_restarts)
        metrics["engine/down"] = float(sum(s.down for s in self.engines))
        metrics["weight_version"] = float(self.version)
        return metrics

    def train_step(self) -> dict[str, float]:
        """One step: take groups from the buffer, train, update the engines; the producer runs
        throughout (it is started by the first step)."""
        metrics: dict[str, float] = self._run(self._train_step())
        return metrics

    # --- evaluation and the end of the run --------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The synchronous loop's evaluation; the last one first stops the producer, whose
        groups no step would train on."""
        if self.step >= self.config.run.steps:
            self._run(self._stop_producer())
        return super().evaluate()

    def close(self, status: str) -> None:
        """Stop the producer, then end the run as the synchronous loop does."""
        try:
            if not self._aio.is_closed():
                self._run(self._stop_producer())
        finally:
            super().close(status)
