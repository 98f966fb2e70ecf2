"""A live embedded engine for the client tests (skipped when that engine is not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of an embedded server over a tiny random Llama."""
    import torch
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    path: Path = tmp_path_factory.mktemp("client-tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    launcher = build(EmbeddedEngineConfig(max_running_requests=2, num_threads=1))
    url = launcher.launch(str(path), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()
