"""Which of two equal layouts runs a linear layer's product faster on this machine.

``F.linear(x, w)`` computes ``x @ w^T``; ``(w @ x^T)^T`` is the same product with the weight
as the left operand. BLAS libraries choose different kernels for the two, and which is faster
depends on the CPU, the library, the dtype and the number of rows. Measured on a 2-core AMD
EPYC with MKL 2024.2 in float32 over SmolLM2-135M's weights: the second layout is 1.25x faster
at 16 rows, 2.5-4x at 2-8 rows, 1.35x at 128 rows; a single row takes a matrix-vector path
as slow as 2 rows should be, and a second (copied) row makes it a matrix product again.
In bfloat16 on the same machine the two are within noise.

So the engine measures both once per process, over the served model's own weights, at a
few row counts, and keeps the faster per row count (the other only when it wins by
``MARGIN``). ``matmul: linear`` or ``transposed`` in the engine's config fixes the choice
(same arithmetic up to rounding: results agree with the model's own forward within float32
rounding either way).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: the row counts measured; a product with ``r`` rows uses the choice of the largest
#: measured count not above ``r``
ROWS = (1, 2, 4, 8, 16, 32, 64)
#: the other layout must be at least this much faster to be chosen
MARGIN = 1.1
#: models whose products read fewer bytes than this are not measured (``linear``): the two
#: layouts differ by microseconds there, and the measurement would cost more
MIN_BYTES = 32 * 2**20
CHOICES = ("auto", "linear", "transposed")

_measured: dict[tuple[object, ...], MatmulPlan] = {}


class MatmulPlan:
    """The layout to use at each row count: ``transposed[i]`` for rows in
    ``[ROWS[i], ROWS[i + 1])`` (the last entry for every count above)."""

    def __init__(self, transposed: Sequence[bool]) -> None:
        if len(transposed) != len(ROWS):
            raise ValueError(f"one choice per row count {ROWS}, got {len(transposed)}")
        self.transposed = tuple(bool(t) for t in transposed)
        self.any = any(self.transposed)

    @classmethod
    def fixed(cls, choice: str) -> MatmulPlan:
        """Every row count with one layout (``linear`` or ``transposed``)."""
        if choice not in ("linear", "transposed"):
            raise ValueError(f"matmul: {choice!r}; allowed: linear, transposed")
        return cls([choice == "transposed"] * len(ROWS))

    def describe(self) -> dict[str, str]:
        """``{"1": "linear", "2": "transposed", ...}``: the choice from each row count on."""
        return {
            str(r): "transposed" if t else "linear"
            for r, t in zip(ROWS, self.transposed, strict=True)
        }

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear(x, w, b)`` in the layout chosen for ``x``'s row count."""
        if not self.any:
            return F.linear(x, w, b)
        rows = x.numel() // x.shape[-1]
        if rows == 0 or not self.transposed[bisect.bisect_right(ROWS, rows) - 1]:
            return F.linear(x, w, b)
        return _transposed(x, w, b, rows)


def _transposed(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int
) -> torch.Tensor:
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:  # a matrix-vector product otherwise: two rows make it a matrix product
        x2 = torch.cat([x2, x2])
    y = torch.mm(w, x2.t()).t()[:rows].contiguous()
    if b is not None:
        y.add_(b)
    return y.view(*x.shape[:-1], w.shape[0])


def plan_for(
    weights: Sequence[torch.Tensor], choice: str = "auto", *, repeats: int = 3
) -> MatmulPlan:
    """The plan for products with ``weights`` (``[out, in]`` each, in the order a forward
    uses them): fixed by ``choice``, or with ``auto`` measured once per process for this set
    of shapes, dtype, device and thread count (CPU only; elsewhere ``linear``)."""
    if choice not in CHOICES:
        raise ValueError(f"matmul: {choice!r}; allowed: {', '.join(CHOICES)}")
    if choice != "auto":
        return MatmulPlan.fixed(choice)
    if not weights:
        return MatmulPlan.fixed("linear")
    w0 = weights[0]
    total = sum(w.numel() * w.element_size() for w in weights)
    if w0.device.type != "cpu" or total < MIN_BYTES:
        return MatmulPlan.fixed("linear")
    key = (
        w0.dtype,
        tuple(tuple(w.shape) for w in weights),
        torch.get_num_threads(),
    )
    if key not in _measured:
        _measured[key] = _measure(weights, repeats)
    return _measured[key]


def _measure(weights: Sequence[torch.Tensor], repeats: int) -> MatmulPlan:
    """Time one pass over every weight in each layout at each row count (interleaved, best
    of ``repeats``); keep ``transposed`` where it wins by ``MARGIN``."""
    gen = torch.Generator().manual_seed(0)
    dims = sorted({w.shape[1] for w in weights})
    dtype = weights[0].dtype
    out = []
    with torch.no_grad():
        for rows in ROWS:
            xs = {d: torch.randn(rows, d, generator=gen).to(dtype) for d in dims}

            def plain(xs: dict[int, torch.Tensor] = xs) -> None:
                for w in weights:
                    F.linear(xs[w.shape[1]], w)

            def swapped(xs: dict[int, torch.Tensor] = xs, rows: int = rows) -> None:
                for w in weights:
                    _transposed(xs[w.shape[1]], w, None, rows)

            best = {plain: float("inf"), swapped: float("inf")}
            for _ in range(repeats):
                for fn in best:
                    t0 = time.perf_counter()
                    fn()
                    best[fn] = min(best[fn], time.perf_counter() - t0)
            out.append(best[swapped] * MARGIN < best[plain])
    return MatmulPlan(out)
