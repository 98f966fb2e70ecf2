"""Options of the p2p transport."""

from __future__ import annotations

from typing import Literal

from miles_transport_common.options import TransportOptions
from pydantic import Field


class P2POptions(TransportOptions):
    """Options of the p2p (NIXL) transport. Control messages and the NIXL agents' metadata go
    over a TCP side channel at ``host:port``; bucket bytes go through NIXL."""

    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where bucket buffers live: 'cpu' (DRAM) or 'cuda' (VRAM)"
    )
    num_buffers: int = Field(
        2,
        ge=1,
        le=8,
        description="bucket buffers on each side used in turn (registered with NIXL once)",
    )
    nixl_backend: Literal["UCX"] = Field("UCX", description="NIXL backend plugin")
