"""``train()``: the whole run, top to bottom, over the parts of a
:class:`~miles_core.runtime.run.Run`: the feed (the schedule, which hands over whole groups and
publishes the weights through the engine fleet), the learner (the trainer), the reporter and
the saver."""

from __future__ import annotations

import time
from typing import Any

from miles_core.runtime.run import Run


def train(run: Run) -> dict[str, Any]:
    """Run the job of ``run`` (built from a validated config); returns its final summary, also
    printed as stdout's last line. A run that stops early keeps its checkpoint, metrics and
    ledger."""
    with run:
        state, feed, learner = run.state, run.feed, run.learner
        reporter, saver = run.reporter, run.saver
        if state.step == 0:
            reporter.evaluate()
        while state.step < run.config.run.steps:
            state.step += 1
            t0 = time.perf_counter()
            groups, metrics = feed.next_batch()
            metrics.update(learner.train_step(groups))
            metrics.update(feed.publish())
            reporter.step_done(groups, metrics, time.perf_counter() - t0)
            if reporter.eval_due():
                reporter.evaluate()
            if saver.due():
                saver.save()
        feed.stop()
        reporter.evaluate()
        state.status = "completed"
        return reporter.finish(saver.outputs())
