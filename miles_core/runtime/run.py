"""One run's parts put together: the built components, the trainer (:class:`Policy`), the
engine fleet, the schedule, the judge and ledger, the checkpointer and the reporter; and the
run's I/O thread, an event loop on which the fleet and the schedule live (so an asynchronous
schedule keeps generating while the trainer trains in the main thread).

:func:`miles_core.runtime.train.train` is the loop over these; this module is what it stands on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from miles_core.components import Kind
from miles_core.config import RunConfig
from miles_core.data import Group, next_free_group_id, reserve_group_ids
from miles_core.errors import MilesUserError
from miles_core.families import require_verified_family
from miles_core.ledger import Ledger
from miles_core.plugins import Plugins
from miles_core.runtime.checkpointer import Checkpointer, set_aside_earlier_run
from miles_core.runtime.export import export_policy, save_adapters
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.guard import OrphanGuard
from miles_core.runtime.judge import Judge
from miles_core.runtime.parts import Parts, build_parts, run_metadata
from miles_core.runtime.policy import Policy
from miles_core.runtime.reporter import Reporter
from miles_core.runtime.rollouts import Rollouts
from miles_core.runtime.schedules import ScheduleContext
from miles_core.runtime.teacher import Teacher, check_teacher

T = TypeVar("T")


def build_family(plugins: Plugins, name: str, options: Any = None) -> Any:
    """Build model family ``name``; a family that cannot load (tokenizer, template) is a user
    error naming its distribution."""
    component = plugins.registry.get(Kind.MODEL_FAMILY, name)
    try:
        return component.build(options)
    except Exception as exc:
        owner = plugins.registry.owner(Kind.MODEL_FAMILY, name).distribution
        raise MilesUserError(
            f"model family {name!r} (from {owner}) could not be built: {exc}"
        ) from None


class Run:
    """A run, used as a context manager: entering checks the input and sets everything up
    (a resumed run from its last checkpoint); leaving saves what must be saved and releases
    the engines, the sender and the trainer in that order, whatever happened."""

    def __init__(
        self,
        config: RunConfig,
        plugins: Plugins,
        *,
        resume: bool = False,
        progress: Literal["auto", "on", "off"] = "auto",
    ) -> None:
        self.config = config
        self.plugins = plugins
        self.hooks = plugins.hooks
        self.resume = resume
        self.run_dir = Path(config.run.output_dir).expanduser() / config.run.name
        self.model_path = str(Path(config.model.path).expanduser())
        self.step = 0
        self.version = 0
        self.ledger = Ledger()
        self.checkpointer = Checkpointer(self.run_dir, config.run.checkpoint_every)
        self.reporter = Reporter(config, plugins, self.run_dir, sinks=[], progress=progress)
        self.parts: Parts | None = None
        self.fleet: EngineFleet | None = None
        self.teacher: Teacher | None = None
        self.status = "failed"
        self.resume_from: Path | None = None  # the checkpoint preflight chose
        # A resumed run writes nothing over its folder's record before its state has loaded.
        self.state_loaded = not resume
        self._guard: OrphanGuard | None = None
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="miles-io", daemon=True)

    def io(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the run's I/O thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- start ------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Checks of the user's input that need no device: refuse before any work."""
        require_verified_family(self.config, self.plugins.registry)
        if not Path(self.model_path).exists():
            raise MilesUserError(f"model.path {self.config.model.path!r} does not exist")
        if self.resume:
            # The newest one that verifies, before any engine or trainer starts.
            self.resume_from = self.checkpointer.latest_verified(self.reporter.log)
        if self.config.teacher is not None:
            check_teacher(self.config.teacher.path, self.model_path)

    def __enter__(self) -> Run:
        self.preflight()
        # Engines run in sessions of their own; the guard stops them if this process is killed
        # before the run can.
        self._guard = OrphanGuard.start()
        self._io.start()
        try:
            self._setup()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _setup(self) -> None:
        config = self.config
        if not self.resume and (moved := set_aside_earlier_run(self.run_dir)) is not None:
            self.reporter.log(f"an earlier run in {self.run_dir} was moved to {moved}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metadata = json.dumps(run_metadata(config, self.plugins), indent=2)
        if not self.resume:
            (self.run_dir / "run.json").write_text(metadata)
        self.parts = parts = build_parts(config, self.plugins)
        self.reporter.sinks = parts.sinks
        self.policy = Policy(parts.trainer)
        parts.trainer.setup(self.model_path)
        self.judge = Judge(self.hooks, parts.sample_filters, parts.group_filters)
        restarts = _restore(self, metadata) if self.resume else 0
        self.reporter.open(self.step)
        self.rollouts = Rollouts(config, parts, self.ledger)
        self.fleet = EngineFleet(
            parts.launcher,
            parts.transport,
            model_path=self.model_path,
            weights=self.policy.weights,
            router=parts.router,
            log=self.reporter.log,
            adapters=parts.adapters,
        )
        self.fleet.restarts = restarts
        self.io(self.fleet.start(self.version))
        if self.version or parts.adapters:  # the checkpoint's weights, or the adapters, first
            self.io(self.fleet.publish(self.version))
        if config.teacher is not None:  # its own engines, started from its checkpoint
            path = str(Path(config.teacher.path).expanduser())
            self.rollouts.teacher = self.teacher = Teacher(
                parts.teacher_launcher, path, log=self.reporter.log
            )
            self.io(self.teacher.start())
        self.schedule = parts.schedule
        self.schedule.attach(
            ScheduleContext(
                config, self.fleet, self.rollouts, self.judge, self.ledger, self.reporter.log
            )
        )
        self.hooks.run_start(config, str(self.run_dir))

    # --- a step -----------------------------------------------------------------------------

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """Train on ``groups``; with ``run.offload`` the engines give their memory to the
        trainer for the step. Returns the step's train metrics."""
        import time

        assert self.parts is not None and self.fleet is not None
        offload = self.config.run.offload
        self.hooks.before_train_step(self.step, groups)
        t0 = time.perf_counter()
        if offload:  # the engines make room, then the trainer takes it back
            self.io(self.fleet.release_memory())
            self.policy.set_awake(True)
        metrics = self.parts.trainer.train_step(groups, self.parts.algorithm)
        if offload:  # the engines take their memory back to receive the weights
            self.io(self.fleet.resume_memory())
        seconds = time.perf_counter() - t0
        self.io(self._trained(groups))
        self.version = int(self.parts.trainer.weight_version)
        self.hooks.after_train_step(self.step, groups, metrics)
        out = {f"train/{k}": float(v) for k, v in metrics.items()}
        out["time/train_s"] = seconds
        return out

    async def _trained(self, groups: list[Group]) -> None:
        for group in groups:
            self.ledger.train(group.group_id)

    def publish(self) -> dict[str, float]:
        """The engines get the new weights the way the schedule needs; the trainer sleeps
        while they generate when ``run.offload`` is set."""
        metrics: dict[str, float] = self.io(self.schedule.publish(self.version))
        if self.config.run.offload:
            self.policy.set_awake(False)
        self.hooks.after_weight_sync(self.step, self.version, metrics)
        return metrics

    def step_metrics(self, groups: list[Group], step_s: float, wait_s: float) -> dict[str, float]:
        """What a step reports beyond its parts' own metrics (``wait_s``: the trainer's wait
        for the step's groups)."""
        from miles_core.runtime.metrics import group_metrics

        by_group = group_metrics(groups)
        by_group["trainer/idle_fraction"] = min(wait_s / max(step_s, 1e-9), 1.0)
        return self.io(self._step_metrics(groups, step_s, by_group))

    async def _step_metrics(
        self, groups: list[Group], step_s: float, by_group: dict[str, float]
    ) -> dict[str, float]:
        assert self.fleet is not None and self.parts is not None
        self.ledger.check()
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(g.num_generated_tokens for g in groups)
        out = dict(by_group)
        out.update(await self.schedule.metrics(self.version))
        out.update({f"ledger/{k}": float(v) for k, v in self.ledger.counts().items()})
        out.update(
            {
                "time/step_s": step_s,
                "samples_per_s": samples / max(step_s, 1e-9),
                "trainer/tokens_per_s": tokens / max(step_s, 1e-9),
                "trainer/groups": float(len(groups)),
                "reward/failure_rate": self.judge.reward_failure_rate,
                "data/skipped_rows": float(self.parts.data.skipped),  # malformed rows
                "engine/restarts": float(self.fleet.restarts),
                "engine/router_restarts": float(self.fleet.router_restarts),
                "weight_version": float(self.version),
            }
        )
        if self.teacher is not None:
            out.update(self.teacher.metrics())
        return out

    def evaluate(self) -> None:
        """The held-out evaluation now: greedy accuracy on the serving engines and the
        trainer's loss on held-out samples (``eval.loss_data``); its metrics at this step."""
        from miles_core.runtime.metrics import heldout_loss

        assert self.fleet is not None and self.parts is not None
        engines = self.fleet.generators()
        metrics = self.io(self.reporter.evaluate(self.rollouts, engines, self.step))
        groups = self.io(self.reporter.heldout_groups(self.rollouts, engines, self.step))
        if groups:
            with self.policy.awake():
                logprobs, _ = self.parts.trainer.compute_logprobs(groups)
            metrics.update(heldout_loss(groups, logprobs))
        self.reporter.evaluated(self.step, metrics)

    def save(self) -> Path:
        """A checkpoint of this step: the trainer's state, then the run's; several adapters
        each also in PEFT's format, in its own folder."""
        save_adapters(self.policy, self.config, f"step_{self.step}")
        return self.checkpointer.save(self.step, self.policy, self.io(self._state()))

    async def _state(self) -> dict[str, Any]:
        assert self.parts is not None and self.fleet is not None
        return {
            "step": self.step,
            "version": self.version,
            "data": self.parts.data.state_dict(),
            "ledger": self.ledger.state_dict(),
            "engine_restarts": self.fleet.restarts,
            "next_group_id": next_free_group_id(),
            **self.judge.state_dict(),
        }

    # --- the end ----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """The run completed: its final JSON line (see :meth:`Reporter.finish`)."""
        self.status = "completed"
        assert self.parts is not None
        final: dict[str, Any] = {
            "steps": self.step,
            "skipped_rows": int(self.parts.data.skipped),
            "reward_failure_rate": self.judge.reward_failure_rate,
        }
        final.update(save_adapters(self.policy, self.config))  # each adapter, in its folder
        if self.config.run.export:  # the policy as a Hugging Face checkpoint
            final.update(export_policy(self.policy, self.model_path, self.run_dir, self.config))
        return self.reporter.finish(final)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, KeyboardInterrupt):
            self.status = "interrupted"
        try:
            self._close()
        finally:
            if self._guard is not None:
                self._guard.stop()
                self._guard = None

    def _close(self) -> None:
        parts = self.parts
        try:
            if parts is not None:
                try:
                    self._stop_generating()
                    if (
                        self.status == "completed"
                        and self.step
                        and not self.checkpointer.has(self.step)
                    ):
                        self.save()
                finally:
                    if self.state_loaded:  # else the previous run's ledger.json stays
                        (self.run_dir / "ledger.json").write_text(
                            json.dumps(self.ledger.counts(), indent=2)
                        )
                    self.reporter.close()
                    # Whatever failed, the engines, the sender and the trainer (and what a
                    # placement reserved for them) are released.
                    try:
                        if self.fleet is not None:
                            self.io(self.fleet.close())
                    finally:
                        try:
                            parts.transport.close()
                        finally:
                            try:
                                if self.teacher is not None:  # its clients, then its servers
                                    self.io(self.teacher.close())
                                parts.launcher.shutdown()
                            finally:
                                parts.trainer.close()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._io.is_alive():
                self._io.join(timeout=30)
            self._loop.close()
            self.hooks.run_end(self.config, str(self.run_dir), self.status)

    def _stop_generating(self) -> None:
        """Stop the schedule; a failure it reports fails a run that was completing, and is
        logged when the run is already failing for another reason."""
        if self.fleet is None:
            return
        try:
            self.io(self.schedule.stop())
        except Exception as exc:
            if self.status == "completed":
                raise
            self.reporter.log(f"stopping the schedule: {exc!r}")


def _restore(run: Run, metadata: str) -> int:
    """Load the checkpoint ``run.preflight`` chose into ``run`` (trainer, data position,
    ledger, step, version, judge), then write its ``run.json`` (``metadata``): only from here
    on is the folder's record this run's. Returns the engine restarts the checkpoint counted."""
    assert run.resume_from is not None and run.parts is not None
    state = run.checkpointer.load(run.resume_from, run.policy)
    run.parts.data.load_state_dict(state["data"])
    run.ledger = state["ledger"]
    reserve_group_ids(max(run.ledger.next_id, int(state.get("next_group_id", 0))))
    run.step, run.version = int(state["step"]), int(state["version"])
    run.judge.load_state_dict(state)
    run.state_loaded = True
    (run.run_dir / "run.json").write_text(metadata)
    return int(state.get("engine_restarts", 0))
