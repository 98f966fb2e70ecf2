"""What a run tells its user: every step's metrics to the sinks and the progress display, the
held-out evaluation, and at the end eval.json, the plot and the final JSON line on stdout."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_core.components import Kind, MetricSink
from miles_core.config import RunConfig
from miles_core.data import Group
from miles_core.hooks import Hooks
from miles_core.plugins import Plugins
from miles_core.runtime.plot import write_plot
from miles_core.runtime.progress import Progress, progress_bar_wanted
from miles_core.runtime.rollouts import Rollouts


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

    def call(self, method: str, *args: Any) -> None:
        """``method(*args)`` on every sink still enabled."""
        for index, (name, essential, sink) in enumerate(self.named):
            if index in self.failed:
                continue
            try:
                getattr(sink, method)(*args)
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


class Reporter:
    """Sinks, progress, evaluation and the final summary of one run."""

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
        self.eval_history: list[tuple[int, float]] = []
        self.loss_history: list[tuple[int, float]] = []
        self._eval_prompts: list[dict[str, Any]] | None = None
        self._loss_records: list[dict[str, Any]] | None = None
        #: each adapter's held-out prompts and (step, accuracy) (a run with ``adapters``)
        self._adapter_prompts: dict[str, list[dict[str, Any]]] = {}
        self.adapter_history: dict[str, list[tuple[int, float]]] = {}
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
        self.guarded.call("open", str(self.run_dir))
        self.progress = Progress(
            self.config.run.steps, start_step, bar=progress_bar_wanted(self.progress_mode)
        )

    def log(self, line: str) -> None:
        """One line on stderr, through the progress display."""
        self.progress.log(line)

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write a step's metrics to every sink (with ``sinks/failures`` once one failed), then
        announce them."""
        metrics = self.guarded.with_failures(metrics)
        self.guarded.call("write", step, metrics)
        self.hooks.metrics_emitted(step, metrics)

    def step_done(self, step: int, metrics: Mapping[str, float]) -> None:
        """A finished step: its metrics out, its progress line written."""
        self.emit(step, metrics)
        self.progress.step_done(step, metrics)

    # --- evaluation -----------------------------------------------------------------------

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` within the run: before training and every
        ``eval.every`` steps (the run also evaluates once after its last step)."""
        every = self.config.eval.every
        return step == 0 or bool(every and step % every == 0)

    async def evaluate(self, rollouts: Rollouts, engines: list[Any], step: int) -> dict[str, float]:
        """Greedy held-out accuracy: one sample per prompt at temperature 0, scored by the
        run's reward (a failed sample scores 0). Empty when the config has no eval data. A run
        that trains several adapters evaluates each on its own ``eval_data`` (else the run's)
        with its own reward (``eval/<name>/...``); ``eval/accuracy`` is then their mean."""
        t0 = time.perf_counter()
        if self.config.adapters:
            metrics = await self._evaluate_adapters(rollouts, engines, step)
        elif self.config.eval.data is None:
            return {}
        else:
            if self._eval_prompts is None:
                self._eval_prompts = self._first_records(self.config.eval.data)
            metrics = _accuracy(await rollouts.greedy(self._eval_prompts, engines, step))
        if metrics:
            metrics["time/eval_s"] = time.perf_counter() - t0
        return metrics

    async def _evaluate_adapters(
        self, rollouts: Rollouts, engines: list[Any], step: int
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        accs, variances, total = [], [], 0.0
        for entry in self.config.adapters:
            selection = entry.eval_data or self.config.eval.data
            if selection is None:
                continue
            if entry.name not in self._adapter_prompts:
                self._adapter_prompts[entry.name] = self._first_records(selection)
            prompts = self._adapter_prompts[entry.name]
            mine = _accuracy(await rollouts.greedy(prompts, engines, step, adapter=entry.name))
            out.update({k.replace("eval/", f"eval/{entry.name}/"): v for k, v in mine.items()})
            self.adapter_history.setdefault(entry.name, []).append((step, mine["eval/accuracy"]))
            accs.append(mine["eval/accuracy"])
            variances.append(mine["eval/stderr"] ** 2)
            total += mine["eval/n"]
        if accs:
            out["eval/accuracy"] = statistics.fmean(accs)
            out["eval/stderr"] = math.sqrt(sum(variances)) / len(accs)
            out["eval/n"] = total
        return out

    def _first_records(self, selection: Any) -> list[dict[str, Any]]:
        source = self.registry.get(Kind.DATA_SOURCE, selection.name).build(selection.options)
        return list(itertools.islice(iter(source), self.config.eval.limit))

    async def heldout_groups(
        self, rollouts: Rollouts, engines: list[Any], step: int
    ) -> list[Group]:
        """The samples the held-out loss is taken on: the first ``eval.limit`` records of
        ``eval.loss_data`` through the run's rollout function. Empty without loss data."""
        selection = self.config.eval.loss_data
        if selection is None:
            return []
        if self._loss_records is None:
            self._loss_records = self._first_records(selection)
        return await rollouts.heldout(self._loss_records, engines, step)

    def evaluated(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record and emit an evaluation made at ``step``."""
        if not metrics:
            return
        said = []
        if "eval/accuracy" in metrics:
            self.eval_history.append((step, metrics["eval/accuracy"]))
            said.append(
                f"accuracy {metrics['eval/accuracy']:.3f} ± {metrics['eval/stderr']:.3f} on "
                f"{int(metrics['eval/n'])} held-out prompts"
            )
        for name in self.adapter_history:
            if f"eval/{name}/accuracy" in metrics:
                said.append(
                    f"{name} {metrics[f'eval/{name}/accuracy']:.3f} ± "
                    f"{metrics[f'eval/{name}/stderr']:.3f}"
                )
        if "eval/loss" in metrics:
            self.loss_history.append((step, metrics["eval/loss"]))
            said.append(
                f"loss {metrics['eval/loss']:.4f} on {int(metrics['eval/loss_n'])} held-out "
                "conversations"
            )
        self.emit(step, metrics)
        self.log(f"eval at step {step}: " + "; ".join(said))

    # --- the end ----------------------------------------------------------------------------

    def finish(self, final: dict[str, Any]) -> dict[str, Any]:
        """Write eval.json (this run's evaluations after a resumed one's) and the plot; print
        the final JSON line (stdout's last) and return it."""
        self.progress.close()
        path = self.run_dir / "eval.json"
        previous = json.loads(path.read_text()) if path.is_file() else {}
        history = [*previous.get("history", []), *self.eval_history]
        losses = [*previous.get("loss_history", []), *self.loss_history]
        summary: dict[str, Any] = {"history": history}
        if history:
            summary.update(
                accuracy_before=history[0][1],
                accuracy_after=history[-1][1],
                n_heldout=len(self._eval_prompts or []),
            )
        if losses:
            summary.update(
                loss_history=losses,
                loss_before=losses[0][1],
                loss_after=losses[-1][1],
                n_heldout_loss=len(self._loss_records or []),
            )
        adapters = previous.get("adapters", {})
        for name, runs in self.adapter_history.items():
            mine = [*adapters.get(name, {}).get("history", []), *runs]
            adapters[name] = {
                "history": mine,
                "accuracy_before": mine[0][1],
                "accuracy_after": mine[-1][1],
                "n_heldout": len(self._adapter_prompts.get(name, [])),
            }
        if adapters:
            summary["adapters"] = adapters
        path.write_text(json.dumps(summary, indent=2))
        plot_path = write_plot(self.run_dir)
        line = {k: v for k, v in summary.items() if k not in ("history", "loss_history")}
        if adapters:  # each adapter's before and after, not its whole history
            line["adapters"] = {
                n: {k: v for k, v in a.items() if k != "history"} for n, a in adapters.items()
            }
        line.update(final)
        line["run_dir"] = str(self.run_dir)
        if plot_path is not None:
            line["plot"] = str(plot_path)
        print(json.dumps(line), flush=True)
        return line

    def close(self) -> None:
        """Close the progress display and the sinks."""
        self.progress.close()
        self.guarded.call("close")


def _accuracy(groups: Sequence[Group]) -> dict[str, float]:
    """The mean reward of greedy held-out samples (1.0 = correct), its standard error and n."""
    scores = [float(g.samples[0].reward or 0.0) for g in groups]
    n = len(scores)
    acc = statistics.fmean(scores) if scores else 0.0
    return {
        "eval/accuracy": acc,
        "eval/stderr": math.sqrt(max(acc * (1 - acc), 0.0) / max(n, 1)),
        "eval/n": float(n),
    }
