"""Options of the colocated transport."""

from __future__ import annotations

from typing import Literal

from miles_transport_common.options import TransportOptions
from pydantic import Field


class ColocatedOptions(TransportOptions):
    """Options of the colocated transport (sender and receivers on one machine / device)."""

    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="'cpu': shared-memory buffers; 'cuda': CUDA IPC handles"
    )
    num_buffers: int = Field(
        2, ge=1, le=8, description="shared bucket buffers used in turn (2 overlaps pack and load)"
    )
