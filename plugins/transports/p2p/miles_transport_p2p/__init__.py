"""Miles's p2p weight transport: the sender writes each bucket straight into the receivers'
registered memory with NIXL (UCX backend): RDMA on GPU clusters, TCP/shared memory on a CPU
machine, the same code path."""

from __future__ import annotations

from miles_transport_p2p.config import P2POptions

__all__ = ["P2POptions"]
