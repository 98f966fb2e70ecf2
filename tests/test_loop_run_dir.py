"""The run folder: a new run never mixes into what an earlier run of the same name left, and
the plot of a resumed run shows each step once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.runtime.checkpointer import set_aside_earlier_run
from miles_core.runtime.plot import write_plot


def test_an_earlier_run_is_moved_aside_not_mixed_in(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "job"
    assert set_aside_earlier_run(run) is None  # nothing there yet
    run.mkdir(parents=True)
    assert set_aside_earlier_run(run) is None  # an empty folder is used as it is
    (run / "run.json").write_text(json.dumps({"config": {"run": {"name": "job"}}}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    first = set_aside_earlier_run(run)
    assert first is not None and not run.exists()
    assert first.parent == run.parent and first.name.startswith("job.")
    assert (first / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost
    assert (first / "checkpoints" / "step_1").is_dir()
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"run": {"name": "job"}}}))
    (run / "ledger.json").write_text("{}")
    second = set_aside_earlier_run(run)  # same second: a distinct name
    assert second is not None and second != first and (second / "ledger.json").is_file()


def test_the_plot_of_a_resumed_run_takes_the_last_row_of_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    rows = [
        {"step": 0, "eval/accuracy": 0.1, "eval/stderr": 0.03},
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2},
        {"step": 3, "reward/mean": 0.9},  # logged by the killed run after its checkpoint
        {"step": 3, "reward/mean": 0.3},  # the resumed run's step 3
        {"step": 4, "reward/mean": 0.4},
        {"step": 4, "eval/accuracy": 0.5, "eval/stderr": 0.05},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[tuple[list[float], list[float]]] = []
    real_plot = matplotlib.axes.Axes.plot

    def spy(self, x, y, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append((list(x), list(y)))
        return real_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    out = write_plot(tmp_path)
    assert out is not None and out.is_file()
    assert drawn[0] == ([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4])
