"""What a run tells its user: every step's metrics (its parts' and the run's own) to the sinks
and the progress display, the held-out evaluation (:mod:`miles_core.runtime.evaluation`), and at
the end eval.json, the plot and the final JSON line on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.components import Kind, MetricSink
from miles_core.config import RunConfig
from miles_core.data import Group
from miles_core.hooks import Hooks
from miles_core.ledger import Ledger
from miles_core.plugins import Plugins
from miles_core.runtime.evaluation import Evaluation
from miles_core.runtime.fleet import EngineFleet
from miles_core.runtime.io import IOThread
from miles_core.runtime.judge import Judge
from miles_core.runtime.metrics import group_metrics, heldout_loss
from miles_core.runtime.plot import write_plot
from miles_core.runtime.policy import Policy
from miles_core.runtime.progress import Progress, progress_bar_wanted
from miles_core.runtime.rollouts import Rollouts
from miles_core.runtime.state import RunState
from miles_core.runtime.teacher import Teacher
from miles_core.runtime.traces import Traces


class GuardedSinks:
    """The run's metric sinks, each call guarded so that a broken sink (a tracking server that
    is down, a full disk under a plugin's folder) does not stop the run: a sink whose ``open``,
    ``write`` or ``close`` raises is reported once (its name and the error), disabled for the
    rest of the run (not retried: a sink that failed once would fail, and log, every step) and
    counted in ``sinks/failures``, which the other sinks receive with every later step. A sink
    whose record is :attr:`~miles_core.components.MetricSink.essential` (``jsonl``: the run's own
    record, the plot and ``eval.json`` are drawn from it) stops the run when it fails."""

    def __init__(
        self,
        sinks: Sequence[Any],
        names: Sequence[str],
        essential: Sequence[bool],
        log: Callable[[str], None],
    ) -> None:
        self.source = sinks
        self.named = list(zip(names, essential, sinks, strict=False))  # no sinks yet: none
        self.log = log
        self.failed: set[int] = set()

    def open(self, run_dir: str) -> None:
        """Every enabled sink's ``open(run_dir)``."""
        self._each("open", lambda sink: sink.open(run_dir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every enabled sink's ``write(step, metrics)``."""
        self._each("write", lambda sink: sink.write(step, metrics))

    def close(self) -> None:
        """Every enabled sink's ``close()``."""
        self._each("close", lambda sink: sink.close())

    def _each(self, method: str, call: Callable[[Any], None]) -> None:
        """``call(sink)`` on every sink still enabled (``method`` names it in the report)."""
        for index, (name, essential, sink) in enumerate(self.named):
            if index in self.failed:
                continue
            try:
                call(sink)
            except Exception as exc:
                if essential:
                    raise
                self.failed.add(index)
                self.log(
                    f"metric sink {name!r} failed in {method}: {type(exc).__name__}: {exc}; "
                    "it is disabled for the rest of the run (counted in sinks/failures)"
                )

    def with_failures(self, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """``metrics`` plus ``sinks/failures`` once a sink has failed."""
        if not self.failed:
            return metrics
        return {**metrics, "sinks/failures": float(len(self.failed))}


@dataclass
class RunView:
    """The parts of a run the reporter reads: for each step's own metrics, the evaluation and
    the final line."""

    state: RunState
    io: IOThread
    schedule: Any
    ledger: Ledger
    judge: Judge
    data: Any
    fleet: EngineFleet
    teacher: Teacher | None
    rollouts: Rollouts
    policy: Policy


class Reporter:
    """Sinks, progress, step metrics, evaluation and the final summary of one run."""

    def __init__(
        self,
        config: RunConfig,
        plugins: Plugins,
        run_dir: Path,
        *,
        sinks: Sequence[Any],
        progress: str,
    ) -> None:
        self.config = config
        self.registry = plugins.registry
        self.hooks: Hooks = plugins.hooks
        self.run_dir = run_dir
        self.sinks = list(sinks)
        self.progress_mode = progress
        self.progress = Progress(config.run.steps, 0, bar=False)
        self.evaluation = Evaluation(config, plugins.registry)
        self.view: RunView | None = None
        self.traces = Traces(config.traces, run_dir)
        self._guarded: GuardedSinks | None = None

    @property
    def guarded(self) -> GuardedSinks:
        """The sinks behind their guard, named as the config selects them."""
        # Built from the sinks the run set (after the reporter was made), once per list.
        if self._guarded is None or self._guarded.source is not self.sinks:
            names = [s.name for s in self.config.metrics.sinks]
            records = [self.registry.get(Kind.METRIC_SINK, n) for n in names]
            essential = [isinstance(r, MetricSink) and r.essential for r in records]
            extra = self.sinks[len(names) :]  # set by a caller beyond the config's
            names += [type(s).__name__ for s in extra]
            essential += [False] * len(extra)
            self._guarded = GuardedSinks(self.sinks, names, essential, self.log)
        return self._guarded

    def open(self, start_step: int) -> None:
        """Open the sinks and the progress display (from ``start_step`` when resuming)."""
        self.guarded.open(str(self.run_dir))
        self.progress = Progress(
            self.config.run.steps, start_step, bar=progress_bar_wanted(self.progress_mode)
        )

    def attach(self, view: RunView) -> None:
        """The run's parts to report on; once they are all set up."""
        self.view = view

    def log(self, line: str) -> None:
        """One line on stderr, through the progress display."""
        self.progress.log(line)

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write a step's metrics to every sink (with ``sinks/failures`` once one failed), then
        announce them."""
        metrics = self.guarded.with_failures(metrics)
        self.guarded.write(step, metrics)
        self.hooks.metrics_emitted(step, metrics)

    # --- a step -----------------------------------------------------------------------------

    def step_done(
        self, groups: list[Group], metrics: Mapping[str, float], step_s: float
    ) -> dict[str, float]:
        """The current step is done (``metrics``: its parts'; ``step_s``: its seconds): the
        run's own metrics added, all out to the sinks, its progress line written. Returns
        what was written."""
        assert self.view is not None
        step = self.view.state.step
        by_group = group_metrics(groups)
        # the trainer's wait for the step's groups
        wait_s = metrics["time/rollout_s"]
        by_group["trainer/idle_fraction"] = min(wait_s / max(step_s, 1e-9), 1.0)
        out = {**metrics, **self.view.io(self._run_metrics(groups, step_s, by_group))}
        out.update(self.traces.write(step, groups, self.view.rollouts.parts.family, self.log))
        self.emit(step, out)
        self.progress.step_done(step, out)
        return out

    async def _run_metrics(
        self, groups: list[Group], step_s: float, by_group: dict[str, float]
    ) -> dict[str, float]:
        # On the I/O thread: the schedule, the ledger and the fleet change there.
        view = self.view
        assert view is not None
        view.ledger.check()
        version = view.state.version
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(g.num_generated_tokens for g in groups)
        out = dict(by_group)
        out.update(await view.schedule.metrics(version))
        out.update({f"ledger/{k}": float(v) for k, v in view.ledger.counts().items()})
        out.update(
            {
                "time/step_s": step_s,
                "samples_per_s": samples / max(step_s, 1e-9),
                "trainer/tokens_per_s": tokens / max(step_s, 1e-9),
                "trainer/groups": float(len(groups)),
                "reward/failure_rate": view.judge.reward_failure_rate,
                "data/skipped_rows": float(view.data.skipped),  # malformed rows
                "engine/restarts": float(view.fleet.restarts),
                "engine/router_restarts": float(view.fleet.router_restarts),
                # engines serving now, and those that joined or left since this process began
                "engine/serving": float(len(view.fleet.serving())),
                "engine/joined": float(view.fleet.membership.joined),
                "engine/left": float(view.fleet.membership.left),
                # joined engines that copied a serving engine's weights instead of waiting
                "engine/copied_weights": float(view.fleet.membership.copied),
                "weight_version": float(version),
            }
        )
        if view.teacher is not None:
            out.update(view.teacher.metrics())
        return out

    # --- evaluation -----------------------------------------------------------------------

    def eval_due(self) -> bool:
        """Whether to evaluate after the current step within the run (see
        :meth:`Evaluation.due`): not after the last, which the run evaluates anyway."""
        assert self.view is not None
        step = self.view.state.step
        return step < self.config.run.steps and self.evaluation.due(step)

    def evaluate(self) -> None:
        """The held-out evaluation now: greedy accuracy on the serving engines and the
        trainer's loss on held-out samples (``eval.loss_data``); its metrics at this step."""
        view = self.view
        assert view is not None
        step = view.state.step
        engines = view.fleet.generators()
        metrics = view.io(self.evaluation.accuracy(view.rollouts, engines, step))
        groups = view.io(self.evaluation.heldout_groups(view.rollouts, engines, step))
        if groups:
            with view.policy.awake():
                logprobs, _ = view.policy.trainer.compute_logprobs(groups)
            metrics.update(heldout_loss(groups, logprobs))
        self.evaluated(step, metrics)

    def evaluated(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record and emit an evaluation made at ``step``."""
        if not metrics:
            return
        said = self.evaluation.record(step, metrics)
        self.emit(step, metrics)
        self.log(f"eval at step {step}: " + "; ".join(said))

    # --- the end ----------------------------------------------------------------------------

    def finish(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """Write eval.json (this run's evaluations after a resumed one's) and the plot; print
        the final JSON line (stdout's last: the evaluation, the steps, the skipped rows, the
        reward failure rate and the run's ``outputs``) and return it."""
        assert self.view is not None
        self.progress.close()
        path = self.run_dir / "eval.json"
        previous = json.loads(path.read_text()) if path.is_file() else self._earlier_evaluations()
        summary = self.evaluation.summary(previous)
        path.write_text(json.dumps(summary, indent=2))
        plot_path = write_plot(self.run_dir)
        line = {k: v for k, v in summary.items() if k not in ("history", "loss_history")}
        adapters = summary.get("adapters")
        if adapters:  # each adapter's before and after, not its whole history
            line["adapters"] = {
                n: {k: v for k, v in a.items() if k != "history"} for n, a in adapters.items()
            }
        line.update(
            steps=self.view.state.step,
            skipped_rows=int(self.view.data.skipped),
            reward_failure_rate=self.view.judge.reward_failure_rate,
        )
        line.update(outputs)
        line["run_dir"] = str(self.run_dir)
        if plot_path is not None:
            line["plot"] = str(plot_path)
        print(json.dumps(line), flush=True)
        return line

    def _earlier_evaluations(self) -> dict[str, Any]:
        """A resumed run whose earlier part stopped before writing ``eval.json`` (a lost node,
        a kill): the accuracy of its evaluations before this process's first, from the
        run's ``metrics.jsonl`` (the last row of each step)."""
        path = self.run_dir / "metrics.jsonl"
        mine = [step for step, _ in self.evaluation.eval_history]
        if not path.is_file() or not mine:
            return {}
        found: dict[int, float] = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill
            if isinstance(row, dict) and "eval/accuracy" in row and row.get("step", 0) < mine[0]:
                found[int(row["step"])] = float(row["eval/accuracy"])
        return {"history": sorted(found.items())} if found else {}

    def close(self) -> None:
        """Close the progress display and the sinks."""
        self.progress.close()
        self.guarded.close()
