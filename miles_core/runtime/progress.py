"""Step progress on stderr: one line per step with its rates and ETA, and a live bar."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import IO, Any


def progress_bar_wanted(mode: str) -> bool:
    """``auto`` draws the live bar only when stdout and stderr are both terminals (a piped or
    logged run gets the per-step lines alone); ``on`` and ``off`` force it."""
    if mode != "auto":
        return mode == "on"
    return sys.stdout.isatty() and sys.stderr.isatty()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Step progress on stderr: one line per step with its rates and ETA, always, and a live
    bar (tqdm when installed, else a carriage-return line) when ``bar`` is true. Lines go out
    through the bar, so it never splits them; stdout is left to the final JSON line."""

    def __init__(self, total: int, start: int, *, bar: bool, stream: IO[str] | None = None) -> None:
        self.total = total
        self.start = start
        self.done = start
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()
        self._bar = bar
        self._line = ""  # the carriage-return bar's current text
        self._tqdm: Any = None
        if bar:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
            except ImportError:  # the plain bar below does the job
                pass
            else:
                self._tqdm = tqdm(
                    total=total,
                    initial=start,
                    file=self.stream,
                    unit="step",
                    desc="train",
                    dynamic_ncols=True,
                )

    def eta_s(self) -> float | None:
        """Seconds left at the mean step time of this process's steps (``None`` before one)."""
        steps = self.done - self.start
        if steps <= 0:
            return None
        return (time.monotonic() - self._t0) / steps * (self.total - self.done)

    def log(self, line: str) -> None:
        """Write one line without breaking the bar."""
        if self._tqdm is not None:
            self._tqdm.write(line, file=self.stream)
        elif self._line:
            self.stream.write(f"\r\x1b[K{line}\n{self._line}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step_done(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log a finished step's line and move the bar."""
        self.done = step
        reward = metrics.get("reward/mean", 0.0)
        rates = (
            f"{metrics.get('samples_per_s', 0.0):.2f} samples/s | "
            f"{metrics.get('rollout/tokens_per_s', 0.0):.1f} tokens/s"
        )
        eta = _clock(self.eta_s())
        # The bar moves first, so the line below is written with the bar already at this step.
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(f"reward {reward:.3f} | {rates}", refresh=False)
            self._tqdm.update(step - self._tqdm.n)
        elif self._bar:
            width = 24
            filled = width * step // max(self.total, 1)
            self._line = (
                f"train [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} | "
                f"reward {reward:.3f} | {rates} | eta {eta}"
            )
        self.log(
            f"step {step}/{self.total} | reward {reward:.3f} | {rates} | "
            f"rollout {metrics.get('time/rollout_s', 0.0):.1f}s "
            f"train {metrics.get('time/train_s', 0.0):.1f}s "
            f"sync {metrics.get('time/sync_s', 0.0):.1f}s | eta {eta}"
        )

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = ""
        self._bar = False
