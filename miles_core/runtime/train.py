"""``train()``: the whole run, top to bottom. Everything it calls is one part of
:class:`~miles_core.runtime.run.Run`: the schedule (which hands over whole groups), the trainer,
the engine fleet (through the schedule's publish), the reporter and the checkpointer."""

from __future__ import annotations

import time
from typing import Any

from miles_core.runtime.run import Run


def train(run: Run) -> dict[str, Any]:
    """Run the job of ``run`` (built from a validated config); returns its final summary, also
    printed as stdout's last line. A run that stops early keeps its checkpoint, metrics and
    ledger."""
    with run:
        if run.step == 0:
            run.evaluate()
        while run.step < run.config.run.steps:
            run.step += 1
            t0 = time.perf_counter()
            groups, metrics = run.io(run.schedule.next_batch(run.step))
            metrics.update(run.train_step(groups))
            metrics.update(run.publish())
            metrics.update(run.step_metrics(groups, time.perf_counter() - t0))
            run.reporter.step_done(run.step, metrics)
            if run.step < run.config.run.steps and run.reporter.eval_due(run.step):
                run.evaluate()
            if run.checkpointer.due(run.step):
                run.save()
        run.io(run.schedule.stop())
        run.evaluate()
        return run.finish()
