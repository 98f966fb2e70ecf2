"""The learning-rate schedule: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    """Multiplier of the peak learning rate at a step (a ``LambdaLR`` lambda whose fields go
    into the scheduler's state dict).

    Warm-up ramps ``(step + 1) / warmup_steps`` so the first step already trains; the cosine
    then falls from 1 at ``warmup_steps`` to ``min_lr_ratio`` at ``decay_steps`` and stays.
    """

    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant" or self.decay_steps is None:
            return 1.0
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
            1.0 + math.cos(math.pi * progress)
        )
