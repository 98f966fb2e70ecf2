"""A tiny random Llama checkpoint, groups and reference helpers for the LoRA adapter's tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.data import Group, Sample

VOCAB = 64


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (untied head) saved with save_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path: Path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def make_groups(n_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[Group]:
    """Groups of random prompts and responses of varied lengths; rewards alternate 1, 0."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        samples = []
        for i in range(group_size):
            s = Sample(prompt_ids=list(prompt))
            n = rng.randint(2, 7)
            s.append(
                [rng.randrange(1, VOCAB) for _ in range(n)],
                logprobs=[-rng.uniform(3.0, 5.0) for _ in range(n)],
                version=0,
            )
            s.reward = float((i + g) % 2)
            samples.append(s)
        groups.append(Group(samples=samples, prompt={"prompt": f"p{g}"}))
    return groups


def hf_logprobs(model: torch.nn.Module, groups: list[Group]) -> torch.Tensor:
    """Reference log-probs ``[B, T]`` of the response tokens: one plain forward per sample."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.response_ids) for s in samples)
    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids).logits[0].float()
            p, n = len(s.prompt_ids), len(s.response_ids)
            logp = torch.log_softmax(logits[p - 1 : p - 1 + n], dim=-1)
            lp = logp.gather(-1, ids[0, p : p + n, None]).squeeze(-1)
            rows.append(torch.nn.functional.pad(lp, (0, width - n)))
    return torch.stack(rows)


def hf_model(path: str) -> Any:
    """The checkpoint as plain Hugging Face loads it, in float32 and eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture
def groups() -> Callable[..., list[Group]]:
    """:func:`make_groups` (test modules are imported by path, so helpers come as fixtures)."""
    return make_groups


@pytest.fixture
def hf() -> Any:
    """Reference helpers: ``hf.model(path)`` and ``hf.logprobs(model, groups)``."""

    class _HF:
        model = staticmethod(hf_model)
        logprobs = staticmethod(hf_logprobs)

    return _HF
