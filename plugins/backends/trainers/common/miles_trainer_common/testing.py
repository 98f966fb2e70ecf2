"""What the trainer backends' tests share: tiny random Hugging Face checkpoints, groups of random
samples, and plain Hugging Face forwards as the reference a backend's log-probs must match.

The FSDP2, Megatron and LoRA tests import from here (their ``conftest.py`` re-exports the
fixtures): each family's tiny checkpoint is described once, so every backend is checked
against the same model. Needs ``transformers`` (each backend's own dependency) and ``pytest``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.data import Group, Sample

#: Vocabulary of every tiny checkpoint (tensor-parallel 2 divides it).
VOCAB = 64


def save_random(config: Any, path: Path, seed: int) -> str:
    """A randomly initialised (``seed``) causal LM of ``config`` saved with
    ``save_pretrained`` into ``path``; returns the path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def llama_config(*, tie_word_embeddings: bool, **extra: Any) -> Any:
    """A 2-layer Llama, 4 heads over 2 key/value groups (grouped-query attention)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )


def qwen3_config(*, head_dim: int, tie_word_embeddings: bool) -> Any:
    """A 2-layer Qwen3 dense (QK-norm), 4 heads over 2 key/value groups of ``head_dim``."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
    )


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (untied head) saved with save_pretrained."""
    config = llama_config(tie_word_embeddings=False)
    return save_random(config, tmp_path_factory.mktemp("llama"), 0)


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


@pytest.fixture
def groups() -> Callable[..., list[Group]]:
    """:func:`make_groups` (test modules are imported by path, so helpers come as fixtures)."""
    return make_groups


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


def hf_response_logprobs(model: torch.nn.Module, groups: list[Group]) -> torch.Tensor:
    """The log-probs of :func:`hf_logprobs` alone, computed without grad."""
    with torch.no_grad():
        return hf_logprobs(model, groups)[0]


def hf_model(path: str) -> Any:
    """The checkpoint as plain Hugging Face loads it, in float32 and eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


class HFReference:
    """Reference helpers as the ``hf`` fixture gives them: ``hf.model(path)`` and
    ``hf.logprobs(model, groups)`` (log-probs and entropies)."""

    model = staticmethod(hf_model)
    logprobs = staticmethod(hf_logprobs)


@pytest.fixture
def hf() -> type[HFReference]:
    """:class:`HFReference`."""
    return HFReference
