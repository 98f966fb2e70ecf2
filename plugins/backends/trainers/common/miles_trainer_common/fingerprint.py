"""A trainer rank's fingerprint: sha256 digests of its whole training state, equal exactly
when the states are bitwise equal (what resume and parity tests compare)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from miles_trainer_common.state import hash_tensor

if TYPE_CHECKING:
    from miles_trainer_common.rank_state import RankState


def optim_digest(
    rank: RankState,
    named: list[tuple[str, nn.Parameter]],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[torch.optim.lr_scheduler.LambdaLR],
    suffix: bytes = b"",
) -> str:
    """Collective: sha256 of each optimizer's state of ``named`` and its schedule's."""
    h = hashlib.sha256()
    for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
        for name, param in named:
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                h.update(f"{name}/{key}".encode())
                v = state[key]
                if isinstance(v, Tensor):
                    hash_tensor(h, rank._state_tensor(v))
                else:
                    h.update(repr(v).encode())
        h.update(repr(scheduler.state_dict()).encode())
    h.update(suffix)
    return rank._combine(h)


def fingerprint(rank: RankState) -> dict[str, str]:
    """Collective: sha256 of the whole weights (``weights``; with adapters, the frozen
    base's) and of the state of every optimizer and schedule and the step
    (``optimizer``); with adapters, of each adapter's tensors (``adapter/<name>``) and of
    its optimizer and schedule (``optimizer/<name>``); once a critic exists, of the
    critic's weights (``critic``) and of its optimizer and schedule (``critic_optimizer``).
    Equal fingerprints mean bitwise-equal training state."""
    model = rank._ready()
    out = {
        "weights": _digest(rank._weight_pairs()),
        "optimizer": optim_digest(
            rank,
            rank._optim_params(model),
            list(rank.optimizers.values()),
            list(rank.schedulers.values()),
            f"step={rank.step}".encode(),
        ),
    }
    for adapter in rank.adapters:
        name = adapter.name
        out[f"adapter/{name}"] = _digest(rank._adapter_pairs(adapter))
        out[f"optimizer/{name}"] = optim_digest(
            rank, rank.trained[name], [rank.optimizers[name]], [rank.schedulers[name]]
        )
    if rank.critic is not None:
        assert rank.critic_optimizer is not None and rank.critic_scheduler is not None
        h = hashlib.sha256()
        for name, value in rank.critic.state_dict().items():
            if isinstance(value, Tensor):
                h.update(name.encode())
                hash_tensor(h, rank._state_tensor(value))
        out["critic"] = rank._combine(h)
        out["critic_optimizer"] = optim_digest(
            rank,
            list(rank.critic.named_parameters()),
            [rank.critic_optimizer],
            [rank.critic_scheduler],
        )
    return out


def _digest(pairs: Iterator[tuple[str, Tensor]]) -> str:
    h = hashlib.sha256()
    for name, tensor in pairs:
        h.update(name.encode())
        hash_tensor(h, tensor)
    return h.hexdigest()
