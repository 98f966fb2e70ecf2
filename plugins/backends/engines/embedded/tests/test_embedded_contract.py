"""The core's engine contract suite against a live embedded server.

The device comes from ``MILES_TEST_ENGINE_DEVICE`` (default ``cpu``; the GPU check
``scripts/device/engine_cuda_check.sh`` sets ``cuda``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles_engine_client import EngineClient

from miles_core.testing.engine_contract import EngineContract, EngineUnderTest, run_with

pytestmark = pytest.mark.slow

DEVICE = os.environ.get("MILES_TEST_ENGINE_DEVICE", "cpu")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tiny_model_v2: Path) -> Iterator[EngineUnderTest]:
    """One embedded server on ``DEVICE`` for the whole suite, through the registered launcher."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    opts = EmbeddedEngineConfig(
        device=DEVICE,
        max_running_requests=4,
        context_length=256,
        num_threads=1,
        startup_timeout_s=180,
    )
    launcher = build(opts)
    url = launcher.launch(str(tiny_model), index=0)
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    try:
        yield EngineUnderTest(
            client=launcher.client(url, timeout_s=120),
            model_path=str(tiny_model),
            alt_model_path=str(tiny_model_v2),
            vocab_size=vocab,
        )
    finally:
        launcher.shutdown()


class TestEmbeddedEngineContract(EngineContract):
    """Every contract test, against the embedded engine, plus the device it was asked for."""

    def test_server_runs_on_requested_device(self, engine: EngineUnderTest) -> None:
        """The server was started with ``DEVICE`` (a CUDA run must not fall back to the CPU)."""

        async def go(c: EngineClient) -> dict[str, Any]:
            return await c.get_server_info()

        info = run_with(engine, go)
        assert info["device"] == DEVICE, info["device"]
