"""Collectives of the broadcast transport's group (formed by
:func:`miles_transport_common.groups.join_update_group`, as SGLang forms it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bcast(pg: dist.ProcessGroup, t: torch.Tensor) -> dist.Work:
    """Start a broadcast of ``t`` from rank 0."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)
