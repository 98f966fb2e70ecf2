"""The process group of one transport, made without touching torch.distributed's default group
(the trainer and the engines keep their own), and the framing of control messages over it."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def make_group(
    store: dist.Store, rank: int, world: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone ``backend`` group of ``world`` ranks; blocks until every rank joined (or
    raises after ``timeout_s``)."""
    prefixed = dist.PrefixStore("miles-broadcast", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world, opts)


def bcast(pg: dist.ProcessGroup, t: torch.Tensor) -> dist.Work:
    """Start a broadcast of ``t`` from rank 0."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def bcast_msg(pg: dist.ProcessGroup, msg: dict[str, Any] | None, device: str) -> dict[str, Any]:
    """Broadcast a JSON message from rank 0 (others pass ``None``) and return it everywhere."""
    body = json.dumps(msg, separators=(",", ":")).encode() if msg is not None else b""
    n = torch.tensor([len(body)], dtype=torch.int64, device=device)
    bcast(pg, n).wait()
    if msg is not None:
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    bcast(pg, data).wait()
    out: dict[str, Any] = json.loads(bytes(data.cpu().numpy()))
    return out


def all_status(pg: dist.ProcessGroup, rank: int, world: int, code: int, device: str) -> list[int]:
    """Every rank contributes a status code (0 = fine); returns all of them, by rank."""
    t = torch.zeros(world, dtype=torch.int64, device=device)
    t[rank] = code
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    return [int(x) for x in t.cpu().tolist()]
