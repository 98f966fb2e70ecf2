"""Tiny random Hugging Face checkpoints and groups for the FSDP2 backend's tests.

The Llama checkpoint, ``groups`` and the ``hf`` reference come from
:mod:`miles_trainer_common.testing`, which the other trainer backends' tests share."""

from __future__ import annotations

import pytest
from miles_trainer_common.testing import (  # noqa: F401 (fixtures pytest finds here)
    VOCAB,
    groups,
    hf,
    llama_path,
    qwen3_config,
    save_random,
)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Qwen3 with tied embeddings saved with save_pretrained."""
    config = qwen3_config(head_dim=8, tie_word_embeddings=True)
    return save_random(config, tmp_path_factory.mktemp("qwen3"), 1)


@pytest.fixture(scope="session")
def qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Qwen3-MoE (4 fused experts, top-2, renormalised; the second layer
    dense) with tied embeddings."""
    from miles_core.testing.tiny_moe import save_tiny_moe

    path = tmp_path_factory.mktemp("qwen3_moe")
    return str(
        save_tiny_moe(
            path, "qwen3_moe", seed=2, vocab_size=VOCAB, hidden_size=32, expert_size=16,
            dense_layers=(1,), tie_word_embeddings=True, scale=4.0,
        )
    )  # fmt: skip


@pytest.fixture(scope="session")
def mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Mixtral (4 fused experts, top-2) with an untied head."""
    from miles_core.testing.tiny_moe import save_tiny_moe

    path = tmp_path_factory.mktemp("mixtral")
    return str(save_tiny_moe(path, "mixtral", seed=3, vocab_size=VOCAB, hidden_size=32, scale=4.0))
