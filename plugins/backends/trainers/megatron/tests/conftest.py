"""Tiny random Hugging Face checkpoints (tensor-parallel 2 divides their heads, key/value
groups, vocabulary and MLP) and groups for the Megatron backend's tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from miles_core.data import Group, Sample

VOCAB = 64


def _save(config: object, path: Path, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def llama_config() -> object:
    """SmolLM2's layout in small: Llama with tied embeddings and grouped-query attention."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def qwen3_config() -> object:
    """Qwen3 dense in small: QK-norm, an untied head, head_dim not hidden / heads."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(llama_config(), tmp_path_factory.mktemp("mg-llama"), 0)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(qwen3_config(), tmp_path_factory.mktemp("mg-qwen3"), 1)


@pytest.fixture(params=["llama", "qwen3"])
def model_path(request: pytest.FixtureRequest) -> str:
    """Each family's tiny checkpoint in turn."""
    return str(request.getfixturevalue(f"{request.param}_path"))


def make_groups(n_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[Group]:
    """Groups of random prompts/responses of varied lengths, rewards alternating 1, 0 within a
    group; one sample per group has untrained (loss_mask 0) tokens in the middle, as a
    multi-turn trajectory does."""
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
            if i == 1:
                s.append([rng.randrange(1, VOCAB) for _ in range(2)], trained=False)
                s.append([rng.randrange(1, VOCAB)], logprobs=[-4.0], version=0)
            s.reward = float((i + g) % 2)
            samples.append(s)
        groups.append(Group(samples=samples, prompt={"prompt": f"p{g}"}))
    return groups


@pytest.fixture
def groups() -> object:
    """:func:`make_groups` (test modules are imported by path, so helpers come as fixtures)."""
    return make_groups


def invariant_logprobs(
    path: str, groups: list[Group], device: str = "cpu", *, invariant: bool = True
) -> list[list[float]]:
    """Each sample's response log-probs from the Hugging Face model's own forward (float32,
    SDPA, one sample at a time) on ``device``; ``invariant``: routed to the batch-invariant
    kernels of :mod:`miles_core.invariant.kernels`, as the embedded engine computes them in
    true on-policy mode."""
    from transformers import AutoModelForCausalLM

    from miles_core.invariant.kernels import invariant_mode, prepare

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model = prepare(model).to(device).eval()
    out = []
    with torch.no_grad(), invariant_mode(invariant):
        for s in (s for g in groups for s in g.samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
            p, n = len(s.prompt_ids), len(s.response_ids)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, p - 1 : p - 1 + n].float(), -1)
            out.append(logp.gather(-1, ids[0, p:, None]).squeeze(-1).tolist())
    return out


@pytest.fixture
def engine_logprobs() -> object:
    """:func:`invariant_logprobs`."""
    return invariant_logprobs


def _resume_is_bitwise(options: object, path: str, groups: list, algo: object, tmp: Path) -> dict:
    """A trainer trains a step, saves, trains another; a new one loads the save and trains the
    same step: its fingerprint must equal the first's (returned)."""
    from miles_backend_megatron.trainer import build

    with build(options) as first:  # type: ignore[arg-type]
        first.setup(path)
        first.train_step(groups, algo)
        first.save(str(tmp / "ckpt"), extra={"data": 7})
        first.train_step(groups, algo)
        expected = first.fingerprint()
    with build(options) as second:  # type: ignore[arg-type]
        second.setup(path)
        second.load(str(tmp / "ckpt"))
        assert second.extra == {"data": 7} and second.weight_version == 1
        second.train_step(groups, algo)
        assert second.fingerprint() == expected
    return expected


@pytest.fixture
def resume_is_bitwise() -> object:
    """:func:`_resume_is_bitwise`: ``(options, path, groups, algo, tmp) -> fingerprint``."""
    return _resume_is_bitwise
