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
    memory: Literal["model", "bucket"] = Field(
        "model",
        description=(
            "'model': the sender keeps two model-sized sets of shared buffers used in turn and "
            "the engines serve straight from the set of the last update (no copy on the engine "
            "side, no engine staging memory; engines on one machine share one copy); 'bucket': "
            "the sender keeps num_buffers bucket-sized buffers and each engine copies the "
            "buckets out (bounded sender memory, one staged model copy per engine)"
        ),
    )
    num_buffers: int = Field(
        2,
        ge=1,
        le=8,
        description="memory='bucket': shared buffers used in turn (2 overlaps pack and load)",
    )
