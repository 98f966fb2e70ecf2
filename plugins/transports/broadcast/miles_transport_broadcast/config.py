"""Options of the broadcast transport."""

from __future__ import annotations

from typing import Literal

from miles_transport_common.options import TransportOptions
from pydantic import Field


class BroadcastOptions(TransportOptions):
    """Options of the broadcast transport (the sending rank is rank 0 of a group of
    ``1 + num_receivers`` ranks, rendezvous through a TCP store at ``host:port``)."""

    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="'gloo' moves CPU tensors, 'nccl' CUDA tensors"
    )
    num_buffers: int = Field(
        2, ge=1, le=8, description="sender bucket buffers in turn (2 overlaps pack and send)"
    )
