"""The progress display of ``miles train``: per-step lines with rates and ETA always, a live bar
(tqdm, or a carriage-return line without it) only when asked or on a terminal, and the bar never
splits a line. The whole-run check (a piped run's last stdout line is the JSON summary) is in
``e2e/test_loop_robustness.py`` and ``e2e/test_resume_sigkill.py``."""

from __future__ import annotations

import io
import os
import re
import sys

import pytest

from miles_core.runtime.progress import Progress, progress_bar_wanted

METRICS = {
    "reward/mean": 0.25,
    "samples_per_s": 12.5,
    "rollout/tokens_per_s": 340.0,
    "time/rollout_s": 0.4,
    "time/train_s": 0.3,
    "time/sync_s": 0.1,
}
LINE = re.compile(
    r"^step (\d+)/4 \| reward 0\.250 \| 12\.50 samples/s \| 340\.0 tokens/s \| "
    r"rollout 0\.4s train 0\.3s sync 0\.1s \| eta (\?|\d+:\d\d:\d\d)$"
)


def _drive(progress: Progress) -> None:
    progress.log("eval at step 1: accuracy 0.500")
    progress.step_done(2, METRICS)
    progress.step_done(3, METRICS)
    progress.log("eval at step 3: accuracy 0.750")
    progress.step_done(4, METRICS)
    progress.close()
    progress.close()  # idempotent


def _whole_lines(out: str) -> list[str]:
    """What a terminal shows of each line: the text after the last carriage return."""
    return [line.split("\r")[-1].replace("\x1b[K", "") for line in out.split("\n")]


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_the_bar_never_splits_a_line(tqdm_installed, monkeypatch):
    if not tqdm_installed:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    stream = io.StringIO()
    _drive(Progress(4, 1, bar=True, stream=stream))  # a resumed run: starts after step 1
    out = stream.getvalue()
    shown = _whole_lines(out)
    steps = [m for line in shown if (m := LINE.match(line))]
    assert [int(m.group(1)) for m in steps] == [2, 3, 4]
    assert steps[0].group(2) != "?" and steps[-1].group(2) == "0:00:00"
    assert "eval at step 1: accuracy 0.500" in shown and "eval at step 3: accuracy 0.750" in shown
    bar = "train:" if tqdm_installed else "train ["
    assert bar in out and "\r" in out
    assert "4/4" in out.split("\n")[-2] or "4/4" in out.split("\n")[-1]


def test_without_a_bar_only_the_lines_are_written():
    stream = io.StringIO()
    _drive(Progress(4, 1, bar=False, stream=stream))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 5
    assert [bool(LINE.match(line)) for line in lines] == [False, True, True, False, True]


def test_the_bar_is_drawn_by_default_only_on_a_terminal(monkeypatch):
    assert progress_bar_wanted("on") and not progress_bar_wanted("off")
    main, other = os.openpty()
    with os.fdopen(other, "w") as tty, io.StringIO() as pipe:
        monkeypatch.setattr(sys, "stdout", tty)
        monkeypatch.setattr(sys, "stderr", tty)
        assert progress_bar_wanted("auto")
        monkeypatch.setattr(sys, "stdout", pipe)  # e.g. `miles train run.yaml > summary.json`
        assert not progress_bar_wanted("auto")
        monkeypatch.setattr(sys, "stdout", tty)
        monkeypatch.setattr(sys, "stderr", pipe)
        assert not progress_bar_wanted("auto")
    os.close(main)
