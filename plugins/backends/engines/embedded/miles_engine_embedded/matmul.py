"""Which layout, and how many rows, run a linear layer's product fastest on this machine.

``F.linear(x, w)`` computes ``x @ w^T``; ``(w @ x^T)^T`` is the same product with the weight
as the left operand. BLAS libraries choose different kernels for the two, and which is faster
depends on the CPU, the library, the dtype and the number of rows. The row count matters on
its own too: some counts fall on a slow path, and the same product over more rows (the extra
ones zeros, their results dropped) takes less time. Measured on a 2-core AMD EPYC with MKL
2024.2 in float32 over SmolLM2-135M's weights (ms for every product of one decode step):

============  ====  ====  ====  ====  ====  ====  ====  ====  ====
rows             1     2     4     7     8    11    13    15    16
============  ====  ====  ====  ====  ====  ====  ====  ====  ====
``linear``      44    78    62   105    67   114    81    88    82
transposed      18    20    30    52    48    81   100   120    67
============  ====  ====  ====  ====  ====  ====  ====  ====  ====

So 13 to 15 rows run fastest padded to 16, 7 padded to 8, and a single row (a matrix-vector
path in either layout) copied once. In bfloat16 on the same machine the layouts are within
noise.

The engine measures both layouts once per process, over the served model's own weights, at
every row count up to ``EXACT`` and at a few above, and keeps per row count the fastest of:
``linear``, or the fastest of ``transposed`` and either layout padded to a larger measured
count, when that wins by ``MARGIN``. ``matmul: linear`` or ``transposed`` in the
engine's config fixes the layout, unpadded (same arithmetic up to rounding: results agree
with the model's own forward within float32 rounding either way).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger("miles_engine_embedded")

#: every row count up to this one is measured (and can be padded to a larger one)
EXACT = 16
#: the row counts measured; a product with ``r`` rows uses the entry of the largest measured
#: count not above ``r`` (its layout; its padding only when ``r`` is that count)
ROWS = (*range(1, EXACT + 1), 32, 64)
#: an alternative (the other layout, or more rows) must be at least this much faster
MARGIN = 1.1
#: models whose products read fewer bytes than this are not measured (``linear``): the two
#: layouts differ by microseconds there, and the measurement would cost more
MIN_BYTES = 32 * 2**20
CHOICES = ("auto", "linear", "transposed")

_measured: dict[tuple[object, ...], MatmulPlan] = {}


class MatmulPlan:
    """The layout at each row count: ``transposed[i]`` for rows in ``[ROWS[i], ROWS[i + 1])``
    (the last entry for every count above); ``pad_to[i]``: the rows a product of exactly
    ``ROWS[i]`` rows runs over (``ROWS[i]``: none added)."""

    def __init__(self, transposed: Sequence[bool], pad_to: Sequence[int] | None = None) -> None:
        if len(transposed) != len(ROWS):
            raise ValueError(f"one choice per row count {ROWS}, got {len(transposed)}")
        pad = tuple(ROWS) if pad_to is None else tuple(int(p) for p in pad_to)
        if len(pad) != len(ROWS) or any(p < r for p, r in zip(pad, ROWS, strict=True)):
            raise ValueError(f"pad_to: one count per row count {ROWS}, none below it")
        self.transposed = tuple(bool(t) for t in transposed)
        self.pad_to = pad
        #: whether any product leaves the plain ``F.linear``
        self.any = any(self.transposed) or pad != tuple(ROWS)

    @classmethod
    def fixed(cls, choice: str) -> MatmulPlan:
        """Every row count with one layout (``linear`` or ``transposed``), unpadded."""
        if choice not in ("linear", "transposed"):
            raise ValueError(f"matmul: {choice!r}; allowed: linear, transposed")
        return cls([choice == "transposed"] * len(ROWS))

    def describe(self) -> dict[str, str]:
        """``{"1": "transposed", ..., "13": "transposed, 16 rows", ...}``: the choice from each
        row count on (and the rows that count is padded to)."""
        out = {}
        for r, t, p in zip(ROWS, self.transposed, self.pad_to, strict=True):
            layout = "transposed" if t else "linear"
            out[str(r)] = layout if p == r else f"{layout}, {p} rows"
        return out

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear(x, w, b)`` in the layout (and over the rows) chosen for ``x``'s row
        count; contiguous."""
        return self.product(x, w, b, contiguous=True)

    def strided(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same values as :meth:`linear`, in whatever memory layout the product gave: the
        transposed layout's ``[out, rows]`` result is not copied into ``[rows, out]`` (for a
        result that only feeds element-wise work and further products)."""
        return self.product(x, w, b, contiguous=False)

    def product(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, contiguous: bool
    ) -> torch.Tensor:
        """:meth:`linear` (``contiguous``) or :meth:`strided`."""
        if not self.any:
            return F.linear(x, w, b)
        rows = x.numel() // x.shape[-1]
        if rows == 0:
            return F.linear(x, w, b)
        i = bisect.bisect_right(ROWS, rows) - 1
        pad = self.pad_to[i] if rows == ROWS[i] else rows
        if not self.transposed[i]:
            if pad == rows:
                return F.linear(x, w, b)
            y = F.linear(_padded(x.reshape(rows, x.shape[-1]), pad), w, b)[:rows]
            return y.view(*x.shape[:-1], w.shape[0])
        return _transposed(x, w, b, rows, pad, contiguous)


def _padded(x2: torch.Tensor, rows: int) -> torch.Tensor:
    """``x2 [r, in]`` with zero rows appended up to ``rows``."""
    return torch.cat([x2, x2.new_zeros(rows - x2.shape[0], x2.shape[1])])


def _transposed(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    rows: int,
    pad: int | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    x2 = x.reshape(rows, x.shape[-1])
    if pad is not None and pad > rows:
        x2 = _padded(x2, pad)
    elif rows == 1:  # a matrix-vector product otherwise: two rows make it a matrix product
        x2 = torch.cat([x2, x2])
    y = torch.mm(w, x2.t()).t()[:rows]
    if contiguous:
        y = y.contiguous()
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


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
        t0 = time.perf_counter()
        _measured[key] = _measure(weights, repeats)
        log.info(
            "matmul: auto measured the product layouts in %.1f s: %s",
            time.perf_counter() - t0,
            _measured[key].describe(),
        )
    return _measured[key]


def _measure(weights: Sequence[torch.Tensor], repeats: int) -> MatmulPlan:
    """Time one pass over every weight in each layout at each row count, best of
    ``repeats`` rounds over all the counts (a burst of load from elsewhere then spoils one
    round of a count, not its every try), then choose per row count (:func:`choose`)."""
    gen = torch.Generator().manual_seed(0)
    dims = sorted({w.shape[1] for w in weights})
    dtype = weights[0].dtype
    inputs = {r: {d: torch.randn(r, d, generator=gen).to(dtype) for d in dims} for r in ROWS}
    costs = {(r, t): float("inf") for r in ROWS for t in (False, True)}
    with torch.no_grad():
        for _ in range(repeats):
            for rows, xs in inputs.items():
                for t in (False, True):
                    t0 = time.perf_counter()
                    for w in weights:
                        x = xs[w.shape[1]]
                        _transposed(x, w, None, rows) if t else F.linear(x, w)
                    costs[rows, t] = min(costs[rows, t], time.perf_counter() - t0)
    return choose(costs)


def choose(costs: dict[tuple[int, bool], float]) -> MatmulPlan:
    """The plan from measured times ``costs[rows, transposed]`` at every count of ``ROWS``.

    For each count: the fastest of ``transposed`` and, up to ``EXACT``, either layout at any
    larger count (padding), when it is ``MARGIN`` times faster than ``linear`` at that count;
    ``linear`` otherwise. Counts above ``EXACT`` choose a layout only."""
    transposed, pad_to = [], []
    for rows in ROWS:
        others = [(costs[rows, True], True, rows)]
        if rows <= EXACT:
            larger = [r for r in ROWS if rows < r <= EXACT]
            others += [(costs[r, t], t, r) for r in larger for t in (False, True)]
        best = min(others, key=lambda c: c[0])
        if best[0] * MARGIN >= costs[rows, False]:
            best = (costs[rows, False], False, rows)
        transposed.append(best[1])
        pad_to.append(best[2])
    return MatmulPlan(transposed, pad_to)
