"""Batched sampling with per-request temperature, top-k, top-p and random stream.

The log-prob returned for a sampled token is taken from the *raw* distribution
(``log_softmax`` of the unmodified logits, temperature 1), which is what a trainer recomputes;
temperature, top-k and top-p change only which token is drawn.

Each request owns a seeded generator and consumes exactly one uniform number per sampled token
(inverse-CDF sampling), so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

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

    ``uniforms`` holds one number in ``[0, 1)`` per row (ignored by greedy rows).
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
    filtered_k = any(0 < k < vocab for k in top_ks)
    filtered_p = any(p < 1.0 for p in top_ps)
    if (
        not filtered_k
        and not filtered_p
        and all(t == 1.0 or g for t, g in zip(temperatures, greedy, strict=True))
    ):
        probs = raw_logprobs.exp()  # the raw distribution itself: no second softmax
    else:
        temps = torch.tensor(
            [1.0 if g else t for t, g in zip(temperatures, greedy, strict=True)], device=dev
        )
        scaled = logits / temps.unsqueeze(1)
        if filtered_k:
            kth = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
            sorted_vals = scaled.sort(dim=-1, descending=True).values
            thresh = sorted_vals.gather(1, (kth - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < thresh, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if filtered_p:
            # A top_p below the dtype's smallest normal number (1e-46 in float32 is 0) keeps
            # the first token only, as its exact value would: never an empty nucleus.
            tiny = torch.finfo(probs.dtype).tiny
            p_t = torch.tensor(
                [max(p, tiny) for p in top_ps], dtype=probs.dtype, device=dev
            ).unsqueeze(1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= p_t, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=dev).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=vocab - 1)
    if any(greedy):
        g = torch.tensor(greedy, device=dev)
        tokens = torch.where(g, logits.argmax(dim=-1), tokens)
    return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
