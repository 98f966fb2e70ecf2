"""The response-token log-prob and entropy gather from a forward's logits."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from miles_trainer_common.truncation import Truncation, kept_mask


def logprobs_at(
    logits: Tensor,
    unit: Tensor,
    pos: Tensor,
    target: Tensor,
    valid: Tensor,
    *,
    entropy: bool,
    truncation: Truncation | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) ``[b, t]`` of ``target`` under the logits of row ``unit[i]``
    at positions ``pos[i, j]``; 0 where not ``valid``.

    ``logits`` is ``[rows, positions, vocab]`` (any float dtype: the log-softmax runs in
    float32); ``unit`` is ``[b]``, ``pos``, ``target`` and ``valid`` are ``[b, t]``, all on the
    logits' device. Differentiable; runs with or without grad as the caller's context says.

    ``truncation`` (the ``[b]`` sampling parameters of samples that were drawn with top-p or
    top-k): each log-prob is then the token's under the distribution the engine drew it from,
    the logits over the tokens the filters kept (:func:`~miles_trainer_common.truncation.
    kept_mask`, every other one at ``-inf``; ``target`` always kept); ``None``: the whole
    vocabulary's. The entropy stays the whole vocabulary's either way.
    """
    picked = logits[unit[:, None], pos].float()
    logp = torch.log_softmax(picked, dim=-1)
    chosen = logp
    if truncation is not None:
        # The drawn token is always in the engine's kept set; it stays in this one where
        # the logits are not bitwise the engine's (outside true on-policy mode) and the set's
        # edge moved past it, and at padding: never a log-prob of -inf.
        kept = kept_mask(picked, truncation).scatter_(-1, target[:, :, None], True)
        chosen = torch.log_softmax(picked.masked_fill(~kept, float("-inf")), dim=-1)
    lp = chosen.gather(-1, target[:, :, None]).squeeze(-1)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp = torch.where(valid, lp, zero)
    ent = None
    if entropy:
        ent = -(logp.exp() * logp).sum(-1)
        ent = torch.where(valid, ent, zero)
    return lp, ent


class OffPolicyTokens(RuntimeError):
    """True on-policy mode: a recomputed log-prob is not bitwise the engine's."""


def check_on_policy(logprobs: Tensor, rollout: Tensor, mask: Tensor, groups: Tensor) -> None:
    """Raise :class:`OffPolicyTokens` unless ``logprobs [B, T]`` (the trainer's) equals
    ``rollout`` (the engine's) bitwise at every trained token (``mask``), naming the first
    sample and response position that differ, and how many do; ``groups [B]`` is each sample's
    group index."""
    lp = logprobs.detach().to("cpu", torch.float32)
    ref = rollout.to("cpu", torch.float32)
    differ = (lp != ref) & (mask.to("cpu") > 0)
    count = int(differ.sum())
    if not count:
        return
    row, col = (int(i) for i in differ.nonzero()[0])
    delta = (lp[differ] - ref[differ]).abs()
    raise OffPolicyTokens(
        f"true on-policy: {count} of {int((mask > 0).sum())} trained tokens differ between the "
        f"trainer and the engine (max |delta log-prob| {float(delta.max()):.3g}); the first is "
        f"sample {row} (group {int(groups[row])}), response position {col}: trainer "
        f"{float(lp[row, col])!r}, engine {float(ref[row, col])!r}"
    )


def by_group(groups: list[Any], lp: Tensor) -> dict[int, Tensor]:
    """The rows of a packed batch's log-probs ``lp`` ``[B, T]`` (``groups``' samples in
    order, :func:`~miles_trainer_common.batch.pack`) per group id, each ``[samples, width]``
    trimmed to the group's longest response."""
    out: dict[int, Tensor] = {}
    row = 0
    for group in groups:
        n = len(group.samples)
        width = max((len(s.response_ids) for s in group.samples), default=0)
        out[group.group_id] = lp[row : row + n, :width].clone()
        row += n
    return out


def set_trainer_logprobs(groups: list[Any], trained: dict[int, Tensor]) -> None:
    """Set each sample's ``trainer_logprobs`` (one per response token) from a train step's
    log-probs per group id (:func:`by_group`); a group the step did not report is left as
    it is."""
    for group in groups:
        lp = trained.get(group.group_id)
        if lp is None:
            continue
        for i, sample in enumerate(group.samples):
            sample.trainer_logprobs = lp[i, : len(sample.response_ids)].tolist()


def set_expert_agreement(groups: list[Any], trained: dict[int, Tensor]) -> None:
    """Set each sample's ``trainer_expert_agreement`` (one per response token, ``None`` where
    the token had no routing record) from a train step's agreement per group id, laid out as
    its log-probs (:func:`by_group`); a group the step did not report is left as it is."""
    for group in groups:
        agree = trained.get(group.group_id)
        if agree is None:
            continue
        for i, sample in enumerate(group.samples):
            values = agree[i, : len(sample.response_ids)].tolist()
            sample.trainer_expert_agreement = [None if math.isnan(v) else v for v in values]
