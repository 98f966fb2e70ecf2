"""Tiny random Hugging Face checkpoints (tensor-parallel 2 divides their heads, key/value
groups, vocabulary and MLP) and groups for the Megatron backend's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from miles_trainer_common import testing
from miles_trainer_common.testing import llama_config, qwen3_config, save_random

from miles_core.data import Group

#: ``groups()``: :func:`miles_trainer_common.testing.make_groups` (random groups, one sample per
#: group with untrained tokens in the middle).
groups = testing.groups


def megatron_llama_config() -> Any:
    """SmolLM2's layout in small: Llama with tied embeddings and grouped-query attention."""
    config = llama_config(
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def megatron_qwen3_config() -> Any:
    """Qwen3 dense in small: QK-norm, an untied head, head_dim not hidden / heads."""
    config = qwen3_config(head_dim=16, tie_word_embeddings=False)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_random(megatron_llama_config(), tmp_path_factory.mktemp("mg-llama"), 0)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_random(megatron_qwen3_config(), tmp_path_factory.mktemp("mg-qwen3"), 1)


@pytest.fixture(params=["llama", "qwen3"])
def model_path(request: pytest.FixtureRequest) -> str:
    """Each family's tiny checkpoint in turn."""
    return str(request.getfixturevalue(f"{request.param}_path"))


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
