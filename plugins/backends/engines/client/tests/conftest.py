"""Live embedded engines for the client and router tests (the repo's bootstrap installs
``miles-engine-embedded`` with this distribution's test extra)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from miles_core.hosts import API_KEY_ENV


def make_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Save a tiny random Llama (hidden 32, 1 layer, vocabulary 96) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of an embedded server over a tiny random Llama."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    path = make_tiny_model(tmp_path_factory.mktemp("client-tiny"))
    launcher = build(EmbeddedEngineConfig(max_running_requests=2, num_threads=1))
    url = launcher.launch(str(path), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Base URLs of two embedded servers over the same tiny random Llama, started at once."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    path = str(make_tiny_model(tmp_path_factory.mktemp("two-engines-tiny")))
    launcher = build(
        EmbeddedEngineConfig(max_running_requests=4, num_threads=1, startup_timeout_s=120)
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            yield list(pool.map(lambda i: launcher.launch(path, index=i), range(2)))
    finally:
        launcher.shutdown()


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``(base URL, key)`` of an embedded server started with the run's API key in its
    environment (``MILES_API_KEY``; the tests' own environment stays without it)."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    key = "client-key-fedcba9876543210"
    path = make_tiny_model(tmp_path_factory.mktemp("keyed-tiny"))
    launcher = build(
        EmbeddedEngineConfig(max_running_requests=2, num_threads=1, startup_timeout_s=120)
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, key)
        url = launcher.launch(str(path), index=0)
    try:
        yield url, key
    finally:
        launcher.shutdown()
