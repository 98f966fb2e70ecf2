"""The response-token log-prob and entropy gather from a forward's logits."""

from __future__ import annotations

import torch
from torch import Tensor


def logprobs_at(
    logits: Tensor, unit: Tensor, pos: Tensor, target: Tensor, valid: Tensor, *, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) ``[b, t]`` of ``target`` under the logits of row ``unit[i]``
    at positions ``pos[i, j]``; 0 where not ``valid``.

    ``logits`` is ``[rows, positions, vocab]`` (any float dtype: the log-softmax runs in
    float32); ``unit`` is ``[b]``, ``pos``, ``target`` and ``valid`` are ``[b, t]``, all on the
    logits' device. Differentiable; runs with or without grad as the caller's context says.
    """
    picked = logits[unit[:, None], pos]
    logp = torch.log_softmax(picked.float(), dim=-1)
    lp = logp.gather(-1, target[:, :, None]).squeeze(-1)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp = torch.where(valid, lp, zero)
    ent = None
    if entropy:
        ent = -(logp.exp() * logp).sum(-1)
        ent = torch.where(valid, ent, zero)
    return lp, ent
