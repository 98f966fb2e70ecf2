"""The trainer's truncated log-probs: what a sample says it was sampled with reaches the packed
batch (malformed values refused naming the field), the log-prob is the truncated
distribution's, and the drawn token always stays in the set."""

from __future__ import annotations

import math

import pytest
import torch
from miles_trainer_common.batch import pack
from miles_trainer_common.logprobs import logprobs_at
from miles_trainer_common.truncation import Truncation, kept_mask, sample_params

from miles_core.data import Group, Sample


def _sample(params: object = None) -> Sample:
    s = Sample(prompt_ids=[1, 2])
    s.append([3, 4], logprobs=[-1.0, -1.0], version=0)
    if params is not None:
        s.sampling_params = params  # type: ignore[assignment]
    return s


def test_pack_carries_the_sampling_params() -> None:
    plain = pack([Group(samples=[_sample(), _sample({"temperature": 1.0, "top_p": 1.0})])])
    assert plain.truncation is None  # nothing truncated: the whole vocabulary's
    packed = pack(
        [
            Group(samples=[_sample({"temperature": 0.7, "top_p": 0.9, "top_k": 20})]),
            Group(samples=[_sample(), _sample({"top_k": 5})]),
        ]
    )
    t = packed.truncation
    assert t is not None
    assert t.top_p.tolist() == [pytest.approx(0.9), 1.0, 1.0]
    assert t.top_k.tolist() == [20, -1, 5]
    assert t.temperature.tolist() == [pytest.approx(0.7), 1.0, 1.0]
    assert t.rows([2, 0]).top_k.tolist() == [5, 20]
    # greedy samples are not truncated
    assert sample_params({"temperature": 0.0, "top_k": 3}, "s") is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1 (off) or an integer >= 1"),
        ({"top_k": 2.5}, "top_k must be -1 (off) or an integer >= 1"),
        ({"top_p": "0.9"}, "top_p must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ([0.9, 20], "must be a mapping"),
    ],
)
def test_malformed_params_are_refused_naming_the_field(params: object, field: str) -> None:
    with pytest.raises(ValueError) as err:
        pack([Group(samples=[_sample(), _sample(params)])])
    assert "sample 1.sampling_params" in str(err.value)
    assert field in str(err.value)


def test_logprob_is_the_truncated_distributions() -> None:
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0, 0.0]]])
    unit, pos = torch.zeros(1, dtype=torch.long), torch.tensor([[0, 1]])
    target, valid = torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool)
    top2 = Truncation(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2]))
    lp, ent = logprobs_at(logits, unit, pos, target, valid, entropy=True, truncation=top2)
    full, full_ent = logprobs_at(logits, unit, pos, target, valid, entropy=True)
    assert lp[0, 0] == torch.log_softmax(logits[0, 0, :2], -1)[1]
    assert lp[0, 0] > full[0, 0]
    assert ent is not None and full_ent is not None and torch.equal(ent, full_ent)
    # a target outside the set (logits not the engine's) stays in it: finite, differentiable
    x = logits.clone().requires_grad_(True)
    outside = torch.tensor([[4, 4]])
    lp, _ = logprobs_at(x, unit, pos, outside, valid, entropy=False, truncation=top2)
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # the kept sets themselves
    kept = kept_mask(logits.float(), top2)
    assert kept[0, 0].tolist() == [True, True, False, False, False]
    assert kept[0, 1].tolist() == [True, True, True, True, True]  # ties with the 2nd all stay
    nucleus = Truncation(torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([-1]))
    assert kept_mask(logits.float(), nucleus)[0, 1].tolist() == [False, False, True, False, False]
    assert math.isclose(
        float(logprobs_at(logits, unit, pos, target, valid, entropy=False, truncation=nucleus)[0][
            0, 1]), 0.0, abs_tol=0.0)  # fmt: skip


def test_pack_puts_each_turns_reward_on_its_last_token() -> None:
    from miles_trainer_common.batch import token_batch

    two = Sample(prompt_ids=[1])
    two.append([5, 6], logprobs=[-1.0, -1.0], version=0)
    two.append([7], trained=False)
    two.append([8], logprobs=[-1.0], version=0)
    two.turn_rewards, two.reward = [0.5, -1.0], 1.0
    plain = _sample()
    plain.reward = 0.0
    packed = pack([Group(samples=[two, plain])])
    assert packed.turn_rewards is not None
    assert packed.turn_rewards.tolist() == [[0.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]
    assert token_batch(packed).turn_rewards is not None
    plain_only = pack([Group(samples=[_sample()])])
    assert plain_only.turn_rewards is None  # episode rewards only: nothing to carry
