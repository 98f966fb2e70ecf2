"""Fixtures of the core's tests.

``make_dist`` writes a real installed distribution (a module plus a ``.dist-info`` folder with
entry points in the ``miles`` group) into a folder that subprocesses put on ``PYTHONPATH``, so
the plugin manager discovers it through ``importlib.metadata`` exactly as it finds a plugin
installed with pip.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def make_dist(tmp_path: Path) -> Callable[..., Path]:
    """Write an installed distribution; returns the folder to put on PYTHONPATH."""
    site = tmp_path / "site"
    site.mkdir()

    def make(dist: str, module: str, source: str, entry_name: str | None = None) -> Path:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[miles]\n{entry_name or module} = {module}\n")
        return site

    return make
