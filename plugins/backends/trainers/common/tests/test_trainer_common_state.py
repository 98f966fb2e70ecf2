"""RNG states, tensor hashes and the log-prob/entropy gather."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from miles_trainer_common.logprobs import logprobs_at
from miles_trainer_common.state import hash_tensor, rng_state, set_rng_state

CPU = torch.device("cpu")


def _draw() -> tuple[float, float, float]:
    return random.random(), float(torch.rand(())), float(np.random.rand())


def test_rng_state_round_trip() -> None:
    state = rng_state(CPU)
    assert set(state) == {"python", "torch", "numpy"}  # no CUDA state on a CPU device
    first = _draw()
    assert _draw() != first
    set_rng_state(state, CPU)
    assert _draw() == first


def test_hash_tensor_sees_bytes_and_dtype() -> None:
    def digest(t: torch.Tensor) -> str:
        h = hashlib.sha256()
        hash_tensor(h, t)
        return h.hexdigest()

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert digest(t) == digest(t.clone())
    assert digest(t.t()) != digest(t)  # the values in memory order, not the layout
    assert digest(t.t()) == digest(t.t().contiguous())
    assert digest(t) != digest(t.to(torch.float64))
    assert digest(torch.zeros(0)) != digest(torch.zeros(0, dtype=torch.int64))
    assert digest(t.requires_grad_(True)) == digest(t.detach())


def test_logprobs_at_picks_rows_and_positions() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    unit = torch.tensor([1, 0, 1])
    pos = torch.tensor([[0, 1, 2], [3, 4, 4], [2, 3, 4]])
    target = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 1]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    lp, ent = logprobs_at(logits, unit, pos, target, valid, entropy=True)
    assert lp.shape == ent.shape == (3, 3) and lp.dtype == torch.float32
    for i in range(3):
        for j in range(3):
            logp = torch.log_softmax(logits[int(unit[i]), int(pos[i, j])], dim=-1)
            if valid[i, j]:
                assert torch.isclose(lp[i, j], logp[target[i, j]])
                assert torch.isclose(ent[i, j], -(logp.exp() * logp).sum())
            else:
                assert lp[i, j] == 0 and ent[i, j] == 0
    lp_only, none = logprobs_at(logits, unit, pos, target, valid, entropy=False)
    assert none is None and torch.equal(lp_only, lp)
    # bf16 logits: the log-softmax runs in float32.
    lp16, _ = logprobs_at(logits.bfloat16(), unit, pos, target, valid, entropy=False)
    assert lp16.dtype == torch.float32


def test_logprobs_at_is_differentiable() -> None:
    logits = torch.randn(1, 3, 4, requires_grad=True)
    valid = torch.tensor([[True, False]])
    lp, ent = logprobs_at(
        logits,
        torch.tensor([0]),
        torch.tensor([[0, 1]]),
        torch.tensor([[2, 3]]),
        valid,
        entropy=True,
    )
    assert ent is not None
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None
    assert logits.grad[0, 0].abs().sum() > 0
    assert (logits.grad[0, 1:] == 0).all()  # a padding position gets no gradient
