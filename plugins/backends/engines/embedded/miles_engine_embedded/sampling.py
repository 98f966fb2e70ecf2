"""Batched sampling with per-request temperature, top-k, top-p and random stream.

The log-prob returned for a sampled token is that of the distribution it was drawn from,
at temperature 1: ``log_softmax`` of the unmodified logits over the tokens top-k and top-p
kept (:func:`kept_tokens`), every other token at ``-inf``; without top-k or top-p (or for a
greedy row) that is the whole vocabulary's. A trainer recomputes the same quantity from its
own logits with the same sort, tie rule and cumulative sum
(``miles_trainer_common.truncation``), so in true on-policy mode the two are bitwise equal.
Temperature changes which token is drawn, and which tokens top-p keeps, never the log-prob's
logits.

Each request owns a seeded generator and consumes exactly one uniform number per sampled token
(inverse-CDF sampling), so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Below this temperature the scaled logits overflow; it means greedy (as in SGLang).
GREEDY_BELOW = 1e-5


class UniformStream:
    """Uniform numbers in ``[0, 1)`` from one seeded generator, drawn in blocks (one
    ``torch.rand`` call per 64 tokens rather than per token)."""

    def __init__(self, seed: int, block: int = 64) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.block = block
        self._buf: list[float] = []

    def next(self) -> float:
        """The next number of the stream."""
        if not self._buf:
            self._buf = torch.rand(
                self.block, generator=self.generator, dtype=torch.float64
            ).tolist()
            self._buf.reverse()
        return self._buf.pop()


def sample(
    logits: torch.Tensor,
    *,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    uniforms: Sequence[float],
    native_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; returns ``(token_ids [B], logprobs [B])``.

    ``uniforms`` holds one number in ``[0, 1)`` per row (ignored by greedy rows). Each
    log-prob is the drawn token's under the distribution it was drawn from, at temperature 1
    (the module's docstring); a greedy row's is the whole vocabulary's.
    ``native_kernel``: float32 CPU logits whose rows all draw from the raw distribution
    (temperature 1 or greedy, no top-k or top-p) are sampled by :func:`.native.sample` (the
    same draw in one call, rounded otherwise; the logits in either layout).
    """
    vocab = logits.shape[1]
    greedy = [t < GREEDY_BELOW for t in temperatures]
    if (
        native_kernel
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and all(t == 1.0 or g for t, g in zip(temperatures, greedy, strict=True))
        and not any(0 < k < vocab for k in top_ks)
        and not any(p < 1.0 for p in top_ps)
    ):
        from miles_engine_embedded import native

        return native.sample(logits, list(uniforms), greedy)
    logits = logits.float()
    dev = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if all(greedy):
        tokens = logits.argmax(dim=-1)
        return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    filtered = any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps)
    if not filtered and all(t == 1.0 or g for t, g in zip(temperatures, greedy, strict=True)):
        probs = raw_logprobs.exp()  # the raw distribution itself: no second softmax
        logprobs = raw_logprobs
    else:
        temps = torch.tensor(
            [1.0 if g else t for t, g in zip(temperatures, greedy, strict=True)], device=dev
        )
        scaled = logits / temps.unsqueeze(1)
        kept = kept_tokens(scaled, top_ps=top_ps, top_ks=top_ks) if filtered else None
        if kept is None:
            probs = torch.softmax(scaled, dim=-1)
            logprobs = raw_logprobs
        else:
            probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
            probs = probs.masked_fill(~kept, 0.0)
            # the distribution drawn from, at temperature 1: the raw logits over the kept set
            logprobs = torch.log_softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=dev).unsqueeze(1) * total
    # a uniform that rounds to 1 in float32 would land past the last token with mass: keep it
    # below the total, so the drawn token is always one the distribution holds
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=vocab - 1)
    if any(greedy):
        g = torch.tensor(greedy, device=dev)
        tokens = torch.where(g, logits.argmax(dim=-1), tokens)
        logprobs = torch.where(g.unsqueeze(1), raw_logprobs, logprobs)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def kept_tokens(
    scaled: torch.Tensor, *, top_ps: Sequence[float], top_ks: Sequence[int]
) -> torch.Tensor:
    """The tokens top-k and top-p keep of each row of ``scaled [B, V]`` (the logits divided by
    the row's temperature), as a boolean ``[B, V]``.

    Top-k keeps every token whose scaled logit is at least the ``k``-th largest (all tokens
    tied with it stay); top-p then keeps, over the softmax of what top-k kept, the smallest
    prefix of the tokens sorted by probability (a stable sort: ties in token order) whose mass
    before the token is below ``top_p`` (the first token always stays). A row with ``top_k``
    -1 (or at least the vocabulary) and ``top_p`` 1 keeps everything.
    """
    vocab = scaled.shape[1]
    dev = scaled.device
    kept = torch.ones_like(scaled, dtype=torch.bool)
    if any(0 < k < vocab for k in top_ks):
        kth = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
        sorted_vals = scaled.sort(dim=-1, descending=True).values
        kept = scaled >= sorted_vals.gather(1, (kth - 1).unsqueeze(1))
    if any(p < 1.0 for p in top_ps):
        probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        # A top_p below the dtype's smallest normal number (1e-46 in float32 is 0) keeps
        # the first token only, as its exact value would: never an empty nucleus. A row at
        # top_p 1 keeps every token (its mass before the last tokens may round to 1).
        tiny = torch.finfo(probs.dtype).tiny
        p_t = torch.tensor(
            [max(p, tiny) if p < 1.0 else math.inf for p in top_ps],
            dtype=probs.dtype,
            device=dev,
        ).unsqueeze(1)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        nucleus = torch.zeros_like(kept).scatter_(1, order, before < p_t)
        kept = kept & nucleus
    return kept
