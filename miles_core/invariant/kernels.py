"""Batch-invariant kernels: the operations of true on-policy mode (``rollout.true_on_policy``).

Imported by both sides: the embedded engine's scheduler and the trainer backends' forward.

In this mode the engine's decode (one new token per request, its keys and values read from a
KV cache, any number of requests batched together) and the trainer's teacher-forced forward
(whole sequences, packed or padded into micro-batches of any size) must give *bitwise* the same
log-prob for every sampled token. Three things make a CPU kernel's result for one row depend on
the rest of the batch, and each has a remedy here:

* **Matrix products** pick their blocking and code path from the matrix shape (a one-row
  product takes another path than a many-row one, and the reduction order changes with it).
  :func:`linear` therefore runs every product as the *same* ``[ROWS, K] x [K, N]`` product:
  the rows are zero-padded to a multiple of :data:`ROWS` and multiplied block by block in one
  batched call. A row's result then depends on its own values alone.
* **Attention** reduces over a number of keys that differs between a decode (the keys the
  cache holds, padded to the longest request of the batch) and a prefill (the whole sequence).
  :func:`attention` splits the keys into fixed tiles of :data:`TILE` anchored at position 0 and
  adds the tiles' partial sums in order, one tile after the other: a tile past a query's last
  visible key adds exact zeros, so a query's result is the same however many keys follow. Its
  products reduce over ``d`` (the head size) or over one tile, fixed lengths that the BLAS
  reduces in one pass, with the query rows of each head padded to a multiple of
  :data:`ATTN_ROWS` (a product of one or two rows takes another path): each element is then the
  same whatever the number of rows (a decode has one per head, a prefill many). This one
  property of the BLAS is what the tests and the trainer's per-step check confirm; the linear
  layers do not rely on it.
* **Reductions over one row of fixed length** (RMSNorm's mean over the hidden size, the
  log-softmax over the vocabulary) are reduced row by row by PyTorch's CPU kernels whatever the
  number of rows; the tests check it for the shapes of the supported families.

:func:`invariant_mode` routes ``torch.nn.functional.linear`` and
``torch.nn.functional.scaled_dot_product_attention`` to these kernels for the code that runs
inside it, so the engine and the trainer run the model's own forward (a Hugging Face
Llama/Qwen module) unchanged, and import the kernels from this one module; :func:`prepare`
makes a mixture of experts run its experts through :func:`linear`. The backward pass (training)
is the ordinary one (plain products, PyTorch's SDPA): only the forward values need to agree.

Both sides must also compute in the same dtype (float32 here) and take the log-softmax of the
same logits; a model whose forward uses another product (an eager attention's ``matmul``) is
not covered (:data:`miles_core.invariant.MODEL_TYPES` names those that are).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

#: rows of every matrix product of a linear layer (a decode of fewer requests is padded up to it)
ROWS = 16
#: attention's query rows are padded to a multiple of this (a decode has one row per head)
ATTN_ROWS = 16
#: keys per attention tile
TILE = 16


#: on CUDA, blocks of :data:`ROWS` rows per batched call, every call the same (see _fixed_mm)
CUDA_BLOCKS = 16


def _fixed_mm(x: Tensor, w_t: Tensor, out: Tensor) -> None:
    """``out [M, N] = x [M, K] @ w_t [K, N]`` as batched products of one shape only,
    ``CUDA_BLOCKS x [ROWS, K] x [K, N]``, the last zero-padded: cuBLAS chooses its kernel by the
    batch count too (on an H200 a row of a 4-sequence batch differed from its decode by 2e-7
    when the count followed the rows), so on CUDA the count is fixed."""
    m, k = x.shape
    n = w_t.shape[1]
    rows = ROWS * CUDA_BLOCKS
    w = w_t.unsqueeze(0).expand(CUDA_BLOCKS, k, n)
    for start in range(0, m, rows):
        chunk = x[start : start + rows]
        c = chunk.shape[0]
        if c < rows:
            chunk = F.pad(chunk, (0, 0, 0, rows - c))
        out[start : start + c] = torch.bmm(chunk.view(CUDA_BLOCKS, ROWS, k), w).view(rows, n)[:c]


def _blocked_mm(x: Tensor, w_t: Tensor, out: Tensor) -> None:
    """``out [M, N] = x [M, K] @ w_t [K, N]``, as batched ``[ROWS, K] x [K, N]`` products: the
    whole blocks of rows in one call, the rest zero-padded to one more block (on CUDA:
    :func:`_fixed_mm`)."""
    if x.is_cuda:
        _fixed_mm(x, w_t, out)
        return
    m, k = x.shape
    n = w_t.shape[1]
    full = m // ROWS
    if full:
        torch.bmm(
            x[: full * ROWS].view(full, ROWS, k),
            w_t.unsqueeze(0).expand(full, k, n),
            out=out[: full * ROWS].view(full, ROWS, n),
        )
    rest = m - full * ROWS
    if rest:
        tail = F.pad(x[full * ROWS :], (0, 0, 0, ROWS - rest))
        out[full * ROWS :] = torch.bmm(tail.unsqueeze(0), w_t.unsqueeze(0))[0, :rest]


class _Linear(torch.autograd.Function):
    """The invariant forward of ``x @ weight.T + bias``; the ordinary backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        # a fresh tensor of the output's shape (not a view: a module's output may be hooked)
        result = x.new_empty(*x.shape[:-1], weight.shape[0])
        out = result.view(-1, weight.shape[0])
        _blocked_mm(flat, weight.t(), out)
        if bias is not None:
            out += bias
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` whose every output row depends on its input row alone (bitwise)."""
    out: Tensor = _Linear.apply(x, weight, bias)  # type: ignore[no-untyped-call]
    return out


def _visible(
    attn_mask: Tensor | None, is_causal: bool, lq: int, lk: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """(boolean ``[.., Lq, Lk]`` of the keys each query sees or None for all, additive float
    mask or None), from SDPA's ``attn_mask`` / ``is_causal``."""
    allowed: Tensor | None = None
    additive: Tensor | None = None
    if is_causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            additive = attn_mask
    return allowed, additive


class _Attention(torch.autograd.Function):
    """The invariant forward of attention; the backward of PyTorch's own SDPA (recomputed from
    the inputs: the gradient needs no invariance, and this keeps no tiled intermediates)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> Tensor:
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.options = (is_causal, scale, enable_gqa)
        return _attention(query, key, value, attn_mask, is_causal, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, attn_mask = ctx.saved_tensors
        is_causal, scale, enable_gqa = ctx.options
        q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
            grads = torch.autograd.grad(out, (q, k, v), grad)
        return (*grads, None, None, None, None)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` whose result for a query depends on that query and
    the keys it sees alone, not on the other queries nor on how many keys follow (bitwise).

    ``query [B, H, Lq, d]``, ``key``/``value [B, Hkv, Lk, d]`` (``H`` a multiple of ``Hkv``:
    grouped-query attention folds the heads sharing a key into the query rows); ``attn_mask``
    boolean (True: attend) or additive, broadcastable to ``[B, H, Lq, Lk]``. Differentiable
    (the gradient is SDPA's)."""
    if dropout_p:
        raise ValueError("the batch-invariant attention has no dropout (dropout_p must be 0)")
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{query.shape[1]} query heads do not share {key.shape[1]} key/value heads"
        )
    out: Tensor = _Attention.apply(  # type: ignore[no-untyped-call]
        query, key, value, attn_mask, is_causal, scale, enable_gqa
    )
    return out


def _attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """The forward of :func:`attention`."""
    b, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    groups = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    allowed, additive = _visible(attn_mask, is_causal, lq, lk, query.device)
    tiles = max(1, -(-lk // TILE))
    pad_k = tiles * TILE - lk
    # the query rows of each key/value head, [B, Hkv, groups * Lq, d], padded to a multiple of
    # ATTN_ROWS (a decode has one row per head: a product of so few rows takes another path)
    rows = groups * lq
    padded = max(1, -(-rows // ATTN_ROWS)) * ATTN_ROWS
    q = query.reshape(b * hkv, rows, d) * scale
    q = F.pad(q, (0, 0, 0, padded - rows))
    if pad_k:  # (a caller that sizes its keys in whole tiles saves these copies)
        key, value = F.pad(key, (0, 0, 0, pad_k)), F.pad(value, (0, 0, 0, pad_k))
    width = tiles * TILE

    def per_row(m: Tensor | None, fill: Any) -> Tensor | None:
        """A ``[.., Lq, Lk]`` mask in the scores' layout ``[B * Hkv, padded, tiles * TILE]``."""
        if m is None:
            return None
        m = m.expand(b, h, lq, lk).reshape(b * hkv, rows, lk)
        return F.pad(m, (0, pad_k, 0, padded - rows), value=fill)

    seen = per_row(allowed, False)
    if seen is None:  # every key seen: only the padding is hidden
        seen = (torch.arange(width, device=q.device) < lk).view(1, 1, width)
    add = per_row(additive, 0.0)
    # scores: a dot product of d terms per (query, key), one [padded, d] x [d, width] product per
    # head
    s = torch.bmm(q, key.reshape(b * hkv, width, d).transpose(1, 2))
    if add is not None:
        s = s + add
    s = s.masked_fill(~seen, float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row seeing nothing
    p = torch.exp(s - top).view(b * hkv, padded, tiles, TILE)
    part = p.sum(dim=-1)  # [B * Hkv, padded, tiles]: the tiles' partial sums
    # each tile's [padded, TILE] x [TILE, d] product: [B * Hkv, tiles, padded, d]
    outs = torch.matmul(p.transpose(1, 2), value.reshape(b * hkv, tiles, TILE, d))
    # the tiles added in order (a running sum: one after the other, from the first); a tile
    # past a query's last key adds exact zeros
    total = part.cumsum(dim=-1)[:, :, -1]
    out = outs.cumsum(dim=1)[:, -1]
    total = torch.where(total > 0, total, torch.ones_like(total))
    out = (out / total.unsqueeze(-1))[:, :rows]
    return out.reshape(b, h, lq, d)


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Make a Hugging Face model's forward one the mode covers; returns it. A mixture of experts
    runs its experts one after the other through ``F.linear`` (transformers' ``eager`` experts
    implementation), each token's expert outputs added in the order of the experts' ids, rather
    than through a grouped product whose blocking depends on how many tokens each expert got."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_experts_implementation", None) not in (
            None,
            "eager",
        ):
            config._experts_implementation = "eager"
    return model


class _InvariantMode(TorchFunctionMode):
    """Routes the covered functions to this module's kernels."""

    ROUTES: ClassVar[dict[Callable[..., Any], Callable[..., Any]]] = {
        F.linear: linear,
        F.scaled_dot_product_attention: attention,
    }

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        route = self.ROUTES.get(func)
        return (route or func)(*args, **(kwargs or {}))


@contextmanager
def invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Within it (on this thread), ``F.linear`` and ``F.scaled_dot_product_attention`` are the
    batch-invariant :func:`linear` and :func:`attention`; ``enabled=False`` changes nothing."""
    if not enabled:
        yield
        return
    with _InvariantMode():
        yield
