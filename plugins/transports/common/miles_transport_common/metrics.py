"""The timing metrics every transport's ``send`` returns."""

from __future__ import annotations


def sync_metrics(
    t0: float, t_sent: float, t1: float, nbytes: int, nbuckets: int
) -> dict[str, float]:
    """Metrics of one update that began at ``t0``, had every byte delivered and verified at
    ``t_sent`` and was committed at ``t1`` (``time.perf_counter`` readings)."""
    return {
        "sync/seconds": t1 - t0,
        "sync/send_seconds": t_sent - t0,
        "sync/bytes": float(nbytes),
        "sync/buckets": float(nbuckets),
        "sync/gb_per_s": nbytes / max(t1 - t0, 1e-9) / 1e9,
    }
