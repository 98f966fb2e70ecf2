"""One run's parts put together: the built components, the trainer (:class:`Policy` and the
:class:`Learner` over it), the engine fleet, the schedule (as the loop's :class:`Feed`), the
judge and ledger, the reporter, the saver and the run's I/O thread, on which the fleet and the
schedule live.

:func:`miles_core.runtime.train.train` is the loop over these parts; a :class:`Run` only sets
them up, in order, and closes them in the reverse order.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

from miles_core.components import Kind
from miles_core.config import RunConfig
from miles_core.data import reserve_group_ids
from miles_core.errors import MilesUserError
from miles_core.families import require_verified_family
from miles_core.ledger import Ledger
from miles_core.plugins import Plugins
from miles_core.runtime.checkpointer import Checkpointer, set_aside_earlier_run
from miles_core.runtime.control import Control
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.guard import OrphanGuard
from miles_core.runtime.io import IOThread
from miles_core.runtime.judge import Judge
from miles_core.runtime.learner import Learner
from miles_core.runtime.parts import Parts, build_parts, run_metadata
from miles_core.runtime.policy import Policy
from miles_core.runtime.reporter import Reporter, RunView
from miles_core.runtime.rollouts import Rollouts
from miles_core.runtime.schedules import Feed, ScheduleContext
from miles_core.runtime.state import RunState, Saver
from miles_core.runtime.teacher import Teacher, check_teacher


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
    """A run's parts, used as a context manager: entering checks the input and sets every
    part up (a resumed run from its last checkpoint), each registering its close as it is
    built; leaving closes them in the reverse order, every one whatever failed before it:
    the schedule stops, a completed run saves, the engines, the sender and the trainer are
    released, the I/O thread ends."""

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
        self.state = RunState(loaded=not resume)
        self.ledger = Ledger()
        self.checkpointer = Checkpointer(self.run_dir, config.run.checkpoint_every)
        self.reporter = Reporter(config, plugins, self.run_dir, sinks=[], progress=progress)
        self.io = IOThread()
        self.parts: Parts | None = None
        self.fleet: EngineFleet | None = None
        self.teacher: Teacher | None = None
        self.resume_from: Path | None = None  # the checkpoint the preflight chose
        self._stack = ExitStack()

    def __enter__(self) -> Run:
        self.resume_from = preflight(self)
        try:
            # Engines run in sessions of their own; the guard stops them if this process is
            # killed before the run can.
            guard = OrphanGuard.start()
            if guard is not None:
                self._stack.callback(guard.stop)
            self._stack.callback(self._announce_end)
            self.io.start()
            self._stack.callback(self.io.close)
            self._setup_trainer()
            self._setup_engines()
            self._record_placement()
            self._setup_loop()
            self.hooks.run_start(self.config, str(self.run_dir))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, KeyboardInterrupt):
            self.state.status = "interrupted"
        self._stack.__exit__(exc_type, exc, tb)
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, MilesUserError)):
            self._say_where_to_resume(exc)

    def _say_where_to_resume(self, exc: BaseException) -> None:
        """After a run failed (a lost trainer node, an engine that cannot be started...): what
        stopped it and the checkpoint ``--resume`` continues from."""
        saved = self.checkpointer.saved()
        where = (
            f"its last checkpoint is {saved[-1].name}: `miles train <config> --resume` continues "
            "from it, on the nodes that remain too (a checkpoint reshards to another world size)"
            if saved
            else "it saved no checkpoint yet"
        )
        self.reporter.log(f"the run stopped at step {self.state.step}: {exc}; {where}")

    def _announce_end(self) -> None:
        self.hooks.run_end(self.config, str(self.run_dir), self.state.status)

    # --- set-up, in order ---------------------------------------------------------------------

    def _setup_trainer(self) -> None:
        """The run folder, the components, the trainer (from the checkpoint when resuming)
        and the reporter."""
        stack, config = self._stack, self.config
        if not self.resume and (moved := set_aside_earlier_run(self.run_dir)) is not None:
            self.reporter.log(f"an earlier run in {self.run_dir} was moved to {moved}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metadata = json.dumps(run_metadata(config, self.plugins), indent=2)
        if not self.resume:
            (self.run_dir / "run.json").write_text(metadata)
        self.parts = parts = build_parts(config, self.plugins)
        # Whatever fails from here on, the trainer (and what a placement reserved for it),
        # the engines' launcher and the sender are released, in that order's reverse.
        stack.callback(parts.trainer.close)
        stack.callback(parts.launcher.shutdown)
        stack.callback(parts.transport.close)
        self.reporter.sinks = parts.sinks
        stack.callback(self.reporter.close)
        stack.callback(self._write_ledger)
        self.policy = Policy(parts.trainer)
        parts.trainer.setup(self.model_path)
        self.judge = Judge(self.hooks, parts.sample_filters, parts.group_filters)
        restarts = self._restore(metadata) if self.resume else 0
        self.reporter.open(self.state.step)
        self.rollouts = Rollouts(config, parts, self.ledger)
        self.fleet = EngineFleet(
            parts.launcher,
            parts.transport,
            model_path=self.model_path,
            weights=self.policy.weights,
            router=parts.router,
            log=self.reporter.log,
            adapters=parts.adapters,
            peer_copy="weights_from_peer" in parts.engine_capabilities,
        )
        self.fleet.restarts = restarts

    def _setup_engines(self) -> None:
        """The engines (the checkpoint's weights, or the adapters, published first), then the
        teacher's, started from its checkpoint."""
        assert self.parts is not None and self.fleet is not None
        fleet, parts, io, config = self.fleet, self.parts, self.io, self.config
        self._stack.callback(lambda: io(fleet.close()))
        io(fleet.start(self.state.version))
        if self.state.version or parts.adapters:
            io(fleet.publish(self.state.version))
        if config.teacher is not None:
            path = str(Path(config.teacher.path).expanduser())
            teacher = Teacher(parts.teacher_launcher, path, log=self.reporter.log)
            self.rollouts.teacher = self.teacher = teacher
            self._stack.callback(lambda: io(teacher.close()))  # its clients, then its servers
            io(teacher.start())

    def _record_placement(self) -> None:
        """``run.json``'s ``placement``: each process a placement plugin started (its node's
        address), and the engine servers' and the router's URLs with their addresses."""
        assert self.fleet is not None
        fleet = self.fleet
        servers = [
            {"role": "engine", "index": e.index, "url": e.url, "address": urlsplit(e.url).hostname}
            for e in fleet.engines
        ]
        if fleet.router_url is not None:
            url = fleet.router_url
            servers.append({"role": "router", "url": url, "address": urlsplit(url).hostname})
        path = self.run_dir / "run.json"
        data = json.loads(path.read_text())
        data["placement"] = {
            "processes": self.hooks.placement_record(self.config),
            "servers": servers,
        }
        path.write_text(json.dumps(data, indent=2))

    def _setup_loop(self) -> None:
        """What the loop drives: the saver, the schedule, the learner, the reporter's view."""
        assert self.parts is not None and self.fleet is not None
        parts, config, state, io = self.parts, self.config, self.state, self.io
        self.saver = Saver(
            config,
            state=state,
            checkpointer=self.checkpointer,
            policy=self.policy,
            io=io,
            data=parts.data,
            ledger=self.ledger,
            judge=self.judge,
            fleet=self.fleet,
            model_path=self.model_path,
            run_dir=self.run_dir,
        )
        self._stack.callback(self.saver.close)
        self.schedule = parts.schedule
        context = ScheduleContext(
            config, self.fleet, self.rollouts, self.judge, self.ledger, self.reporter.log
        )
        self.schedule.attach(context)
        offload = config.run.offload
        self.feed = Feed(
            self.schedule,
            io=io,
            policy=self.policy,
            hooks=self.hooks,
            state=state,
            offload=offload,
            log=self.reporter.log,
            control=Control(
                self.run_dir,
                self.fleet,
                self.reporter.log,
                grow=lambda engines: self.hooks.engines_to_add(self.config, engines),
            ),
        )
        self._stack.callback(self.feed.close)
        self.learner = Learner(
            policy=self.policy,
            algorithm=parts.algorithm,
            fleet=self.fleet,
            io=io,
            ledger=self.ledger,
            hooks=self.hooks,
            state=state,
            offload=offload,
        )
        view = RunView(
            state=state,
            io=io,
            schedule=self.schedule,
            ledger=self.ledger,
            judge=self.judge,
            data=parts.data,
            fleet=self.fleet,
            teacher=self.teacher,
            rollouts=self.rollouts,
            policy=self.policy,
        )
        self.reporter.attach(view)

    def _restore(self, metadata: str) -> int:
        """Load the checkpoint the preflight chose (trainer, data position, ledger, step,
        version, judge), then write its ``run.json`` (``metadata``): only from here on is the
        folder's record this run's. Returns the engine restarts the checkpoint counted."""
        assert self.resume_from is not None and self.parts is not None
        state = self.checkpointer.load(self.resume_from, self.policy)
        self.parts.data.load_state_dict(state["data"])
        self.ledger = state["ledger"]
        reserve_group_ids(max(self.ledger.next_id, int(state.get("next_group_id", 0))))
        self.state.step, self.state.version = int(state["step"]), int(state["version"])
        self.judge.load_state_dict(state)
        self.state.loaded = True
        (self.run_dir / "run.json").write_text(metadata)
        return int(state.get("engine_restarts", 0))

    def _write_ledger(self) -> None:
        """The ledger's counts in the run folder (a resumed run that did not load its state
        leaves the previous run's)."""
        if self.state.loaded:
            (self.run_dir / "ledger.json").write_text(json.dumps(self.ledger.counts(), indent=2))


def preflight(run: Run) -> Path | None:
    """Checks of the user's input that need no device, before any work; returns the
    checkpoint a resumed run starts from (the newest that verifies)."""
    config = run.config
    require_verified_family(config, run.plugins.registry)
    if not Path(run.model_path).exists():
        raise MilesUserError(f"model.path {config.model.path!r} does not exist")
    resume_from = run.checkpointer.latest_verified(run.reporter.log) if run.resume else None
    if config.teacher is not None:
        check_teacher(config.teacher.path, run.model_path)
    return resume_from
