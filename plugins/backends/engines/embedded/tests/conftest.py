"""Fixtures: a tiny random Llama saved to disk, and a live embedded server on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

VOCAB = 128
EOS = 2


def make_tiny_model(path: Path, *, seed: int = 0, family: str = "llama") -> Path:
    """Save a tiny random causal LM (hidden 64, 2 layers, GQA) to ``path``: a dense ``llama``
    or ``qwen3``, or a mixture of experts (``qwen3_moe``, ``mixtral``: 4 experts, top-2; the
    ``qwen3_moe`` keeps its second layer dense, so both kinds of layer are served)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from miles_core.testing.tiny_moe import MOE_ARCHITECTURES, save_tiny_moe

    if family in MOE_ARCHITECTURES:
        dense = (1,) if family == "qwen3_moe" else ()
        return save_tiny_moe(path, family, seed=seed, scale=8.0, dense_layers=dense)

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**common) if family == "llama" else Qwen3Config(head_dim=16, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    # Random init is nearly uniform; larger weights make distributions peaked, so sampling
    # and stop tokens are exercised like on a trained model.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_model():  # type: ignore[no-untyped-def]
    """The tiny-model builder, for tests that need their own."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights (for weight updates)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-v2"), seed=1)


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[str]:
    """A live embedded server (through the registered launcher); yields its base URL. Its
    products run in the transposed layout (``matmul``), so the server tests (the
    teacher-forced fidelity ones included) cover it; the in-process tests cover ``linear``,
    what ``auto`` gives a tiny model."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    opts = EmbeddedEngineConfig(
        max_running_requests=4,
        context_length=200,
        num_threads=1,
        startup_timeout_s=120,
        matmul="transposed",
    )
    launcher = build(opts)
    url = launcher.launch(str(tiny_model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


@pytest.fixture(scope="session")
def reference(tiny_model: Path):  # type: ignore[no-untyped-def]
    """The same tiny model loaded in this process, for teacher-forced checks."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def teacher_forced():  # type: ignore[no-untyped-def]
    """``f(model, prompt, output, top_k=None)``: log-prob of each output token under one full
    forward; with ``top_k``, under the softmax of each position's ``top_k`` largest logits
    (every logit tied with the k-th kept), as an engine that sampled with ``top_k`` reports."""
    import torch

    def logprobs(  # type: ignore[no-untyped-def]
        model, prompt: list[int], output: list[int], top_k: int | None = None
    ) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits.float()
        rows = logits[0, len(prompt) - 1 : -1]
        if top_k is not None:
            kth = rows.topk(top_k, dim=-1).values[:, -1:]
            rows = rows.masked_fill(rows < kth, float("-inf"))
        lp = torch.log_softmax(rows, dim=-1)
        return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1).tolist()

    return logprobs
