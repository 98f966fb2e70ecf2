"""Fixtures of the core's tests and of the end-to-end tests in ``e2e/``.

``make_dist`` writes a real installed distribution (a module plus a ``.dist-info`` folder with
entry points in the ``miles`` group) into a folder that subprocesses put on ``PYTHONPATH``, so
the plugin manager discovers it through ``importlib.metadata`` exactly as it finds a plugin
installed with pip. ``tiny_qwen3`` and ``tiny_qwen3_full_vocab`` are the tiny models the runs
train (saved once a test module), ``reward_site`` the reward plugin they install.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from core_support import DIVERSITY, QWEN3_TOKENS, save_tiny_qwen3, write_dist


@pytest.fixture
def make_dist(tmp_path: Path) -> Callable[..., Path]:
    """Write an installed distribution; returns the folder to put on PYTHONPATH."""
    site = tmp_path / "site"

    def make(dist: str, module: str, source: str, entry_name: str | None = None) -> Path:
        return write_dist(site, dist, module, source, entry_name)

    return make


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 over exactly the qwen3 family's tokens, so every id it samples
    decodes."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", vocab_size=QWEN3_TOKENS)


@pytest.fixture(scope="module")
def tiny_qwen3_full_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary size, so the qwen3 family's tokenizer
    ids are valid inputs."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def reward_site(tmp_path: Path) -> Path:
    """A site folder (for ``core_support.train``) with the ``diversity`` reward of
    ``core_support.DIVERSITY``, its entry point named ``diversity``."""
    return write_dist(
        tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY, "diversity"
    )
