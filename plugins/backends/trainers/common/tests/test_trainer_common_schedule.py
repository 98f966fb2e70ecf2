"""The learning-rate schedule: linear warm-up, then constant or cosine."""

from __future__ import annotations

import pytest
from miles_trainer_common.schedule import LRSchedule


def test_schedule_values() -> None:
    warm = LRSchedule(warmup_steps=4)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = LRSchedule(warmup_steps=2, schedule="cosine", decay_steps=6, min_lr_ratio=0.1)
    values = [cos(s) for s in range(8)]
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[6] == pytest.approx(0.1) and values[7] == pytest.approx(0.1)
