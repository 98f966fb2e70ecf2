"""Tiny random Hugging Face checkpoints and groups for the FSDP2 backend's tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from miles_core.data import Group, Sample

VOCAB = 64


def _save(config: object, path: Path, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (untied head) saved with save_pretrained."""
    from transformers import LlamaConfig

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
    return _save(config, tmp_path_factory.mktemp("llama"), 0)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Qwen3 with tied embeddings saved with save_pretrained."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return _save(config, tmp_path_factory.mktemp("qwen3"), 1)


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


def make_groups(
    n_groups: int = 2, group_size: int = 4, seed: int = 0, env_tokens: bool = True
) -> list[Group]:
    """Groups of random prompts/responses of varied lengths; rewards alternate 1, 0 within a
    group; with ``env_tokens`` one sample per group has untrained (loss_mask 0) tokens in the
    middle, as a multi-turn trajectory does."""
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
            if env_tokens and i == 1:
                s.append([rng.randrange(1, VOCAB) for _ in range(2)], trained=False)
                s.append([rng.randrange(1, VOCAB)], logprobs=[-4.0], version=0)
            s.reward = float((i + g) % 2)
            samples.append(s)
        groups.append(Group(samples=samples, prompt={"prompt": f"p{g}"}))
    return groups


def hf_logprobs(model: torch.nn.Module, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference log-probs and entropies ``[B, T]`` of the response tokens: one plain
    Hugging Face forward per sample (teacher forcing, no padding), in the caller's grad mode."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.response_ids) for s in samples)
    lps, ents = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0].float()
        p, n = len(s.prompt_ids), len(s.response_ids)
        logp = torch.log_softmax(logits[p - 1 : p - 1 + n], dim=-1)
        lp = logp.gather(-1, ids[0, p : p + n, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        lps.append(torch.nn.functional.pad(lp, (0, width - n)))
        ents.append(torch.nn.functional.pad(ent, (0, width - n)))
    return torch.stack(lps), torch.stack(ents)


def hf_model(path: str) -> torch.nn.Module:
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
def hf() -> Callable[..., object]:
    """Reference helpers: ``hf.model(path)`` and ``hf.logprobs(model, groups)``."""

    class _HF:
        model = staticmethod(hf_model)
        logprobs = staticmethod(hf_logprobs)

    return _HF
