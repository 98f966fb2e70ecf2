"""Fixtures of the core's tests.

``make_dist`` writes a real installed distribution (a module plus a ``.dist-info`` folder with
entry points in the ``miles`` group) into a folder that subprocesses put on ``PYTHONPATH``, so
the plugin manager discovers it through ``importlib.metadata`` exactly as it finds a plugin
installed with pip.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from core_support import write_dist


@pytest.fixture
def make_dist(tmp_path: Path) -> Callable[..., Path]:
    """Write an installed distribution; returns the folder to put on PYTHONPATH."""
    site = tmp_path / "site"

    def make(dist: str, module: str, source: str, entry_name: str | None = None) -> Path:
        return write_dist(site, dist, module, source, entry_name)

    return make
