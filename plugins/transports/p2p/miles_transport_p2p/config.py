"""Options of the p2p transport."""

from __future__ import annotations

from typing import Literal

from miles_transport_common.options import TransportOptions
from pydantic import Field

#: The engine's extension path that serves the ``p2p_weights`` capability: the transport's
#: record declares it (``receiver_route``, mounted by an engine that embeds the receiver) and
#: the sender posts each update to it. SGLang has no such path.
RECEIVER_ROUTE = "/miles/p2p_weights"


class P2POptions(TransportOptions):
    """Options of the p2p (NIXL) transport. Control messages and the NIXL agents' metadata go
    over a TCP side channel at ``host:port``; bucket bytes go through NIXL."""

    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where bucket buffers live: 'cpu' (DRAM) or 'cuda' (VRAM)"
    )
    zero_copy: bool = Field(
        True,
        description=(
            "write each bucket's pieces straight from the trainer's tensors (registered with "
            "NIXL for the duration of the update); false: pack them into num_buffers registered "
            "buffers first"
        ),
    )
    num_buffers: int = Field(
        2,
        ge=1,
        le=8,
        description="zero_copy=false: packing buffers used in turn (registered once); and the "
        "receiver's regions used in turn in bucket staging",
    )
    nixl_backend: Literal["UCX"] = Field("UCX", description="NIXL backend plugin")
