"""Fixtures of the launcher process-management tests: options that run the stand-in server
(``sglang_launcher_standin.py``, not SGLang) through the launcher's normal code path."""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from miles_engine_sglang.options import SGLangEngineConfig

TESTS_DIR = Path(__file__).resolve().parent


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int, stride: int) -> int:
    """A base port such that ``base + i * stride`` is free for ``i < count`` right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count * stride)
        if all(_free(base + i * stride) for i in range(count)):
            return base
    raise RuntimeError("no free port block found")


@pytest.fixture
def standin_options(tmp_path: Path) -> Callable[..., SGLangEngineConfig]:
    """Build options that launch the stand-in instead of SGLang (free ports, short timeouts,
    logs under ``tmp_path``); keyword arguments override any option."""

    def make(count: int = 1, **overrides: Any) -> SGLangEngineConfig:
        stride = overrides.pop("port_stride", 7)
        env = {"PYTHONPATH": str(TESTS_DIR), **overrides.pop("env", {})}
        values: dict[str, Any] = {
            "python": sys.executable,
            "server_module": "sglang_launcher_standin",
            "port": free_port_block(count, stride),
            "port_stride": stride,
            "env": env,
            "log_dir": str(tmp_path / "logs"),
            "startup_timeout_s": 30.0,
            "shutdown_grace_s": 5.0,
        }
        values.update(overrides)
        return SGLangEngineConfig(**values)

    return make
