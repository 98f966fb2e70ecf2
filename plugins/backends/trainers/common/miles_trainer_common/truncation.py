"""Truncated sampling kept on-policy: the tokens top-k and top-p kept when the engine drew a
sample's tokens, recomputed from the trainer's logits.

An engine that samples with ``top_p < 1`` or ``top_k`` draws each token from the logits
restricted to the tokens the filters keep, renormalised; it reports the token's log-prob under
that distribution at temperature 1 (the embedded engine does, ``miles_engine_embedded.sampling``).
The trainer computes the same quantity: :func:`kept_mask` finds the kept set of every position
from its own logits with the engine's operations (the logits divided by the temperature, the
top-k threshold with every tie kept, the softmax of what top-k kept, a stable descending sort,
the cumulative sum, the same float32 bounds), and the log-softmax then runs over the logits
with every other token at ``-inf``. With the batch-invariant kernels the logits are bitwise the
engine's, so the kept set and the log-prob are too.

A sample says what it was sampled with in ``Sample.sampling_params``: a mapping with SGLang's
names ``temperature``, ``top_p`` and ``top_k``, written by the rollout function that generated
it (the built-in ``single_turn`` does). A sample without it is trained on the whole
vocabulary's log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: below this temperature a request is greedy (the engine's rule, as SGLang's): no truncation
GREEDY_BELOW = 1e-5


@dataclass
class Truncation:
    """Per-sample sampling parameters ``[B]`` of a batch: ``temperature`` and ``top_p``
    float32, ``top_k`` int64 (-1: off). :meth:`rows` selects a micro-batch's samples."""

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor

    def rows(self, rows: Sequence[int]) -> Truncation:
        """The parameters of samples ``rows``, in that order."""
        index = torch.tensor(list(rows), dtype=torch.long)
        return Truncation(self.temperature[index], self.top_p[index], self.top_k[index])


def _number(params: Mapping[str, Any], name: str, default: float, where: str) -> float:
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{where}.{name} must be a number, got {value!r}")
    return float(value)


def sample_params(params: Any, where: str) -> tuple[float, float, int] | None:
    """``(temperature, top_p, top_k)`` of a sample's ``sampling_params`` when it truncated
    (top_p < 1 or top_k >= 1, not greedy), else ``None``; malformed values raise
    ``ValueError`` naming ``where`` and the field."""
    if params is None:
        return None
    where = f"{where}.sampling_params"
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a mapping of temperature, top_p and top_k")
    temperature = _number(params, "temperature", 1.0, where)
    top_p = _number(params, "top_p", 1.0, where)
    top_k = _number(params, "top_k", -1, where)
    if temperature < 0:
        raise ValueError(f"{where}.temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{where}.top_p must be in (0, 1], got {top_p}")
    if top_k != int(top_k) or top_k == 0 or top_k < -1:
        raise ValueError(f"{where}.top_k must be -1 (off) or an integer >= 1, got {top_k}")
    if temperature < GREEDY_BELOW or (top_p >= 1.0 and top_k == -1):
        return None
    return temperature, top_p, int(top_k)


def batch_truncation(params: Sequence[tuple[float, float, int] | None]) -> Truncation | None:
    """The batch's :class:`Truncation` from each sample's :func:`sample_params` (a sample
    without keeps everything); ``None`` when no sample truncated."""
    if all(p is None for p in params):
        return None
    full = [p or (1.0, 1.0, -1) for p in params]
    return Truncation(
        temperature=torch.tensor([p[0] for p in full], dtype=torch.float32),
        top_p=torch.tensor([p[1] for p in full], dtype=torch.float32),
        top_k=torch.tensor([p[2] for p in full], dtype=torch.long),
    )


def kept_mask(logits: Tensor, truncation: Truncation) -> Tensor:
    """The tokens kept at every position of ``logits [b, t, V]`` (float32), the row ``i``
    sampled with ``truncation``'s ``[b]`` parameters, as a boolean ``[b, t, V]``; no grad.

    The engine's rule and operations: top-k keeps every token at least the ``k``-th largest
    scaled logit; top-p keeps, over the softmax of what top-k kept, sorted descending (stable:
    ties in token order), each token whose mass before it is below ``top_p`` (at least the
    smallest normal float32, so the first token always stays; ``top_p`` 1 keeps all)."""
    with torch.no_grad():
        vocab = logits.shape[-1]
        temps = truncation.temperature.to(logits.device)[:, None, None]
        scaled = logits / temps
        top_k = truncation.top_k.to(logits.device)
        kth = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        kept = torch.ones_like(scaled, dtype=torch.bool)
        if bool(((top_k > 0) & (top_k < vocab)).any()):
            sorted_vals = scaled.sort(dim=-1, descending=True).values
            index = (kth - 1)[:, None, None].expand(-1, scaled.shape[1], 1)
            kept = scaled >= sorted_vals.gather(-1, index)
        top_p = truncation.top_p.to(logits.device)
        if bool((top_p < 1.0).any()):
            probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
            tiny = torch.finfo(probs.dtype).tiny
            bound = torch.where(top_p < 1.0, top_p.clamp(min=tiny), math.inf)
            sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            nucleus = torch.zeros_like(kept).scatter_(-1, order, before < bound[:, None, None])
            kept = kept & nucleus
        return kept
