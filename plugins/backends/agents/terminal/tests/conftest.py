"""Every terminal test records when it started, so the leftover-process checks count only what
that test started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import mark_test_start


@pytest.fixture(autouse=True)
def _mark_test_start() -> None:
    mark_test_start()
