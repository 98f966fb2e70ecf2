"""The engine side of the colocated transport."""

from __future__ import annotations

from typing import Any

import torch
from miles_transport_common.bucketing import Manifest
from miles_transport_common.errors import BucketRejected
from miles_transport_common.session import SocketReceiver

from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.handles import OpenedBuffer


class ColocatedReceiver(SocketReceiver):
    """Reads each bucket in place from the sender's shared buffer, verifies it, and stages or
    loads its tensors (see ``staging``).

    ``memory="model"``: the buffers of an update stay untouched until the update after next, so
    staged tensors are views of them and a target that adopts serves straight from them (no
    copy). ``memory="bucket"``: the sender reuses a buffer after the ack, so tensors are copied
    out first."""

    transport = "colocated"

    def __init__(
        self, options: ColocatedOptions, address: tuple[str, int], *, version: int = 0
    ) -> None:
        super().__init__(options, address, version=version, device=options.device)
        self.owned_buckets = options.memory == "model"
        self._opened: dict[tuple[int, int], OpenedBuffer] = {}

    def bucket_data(self, msg: dict[str, Any], manifest: Manifest) -> torch.Tensor:
        """A view of the shared buffer that holds the bucket."""
        slot = (int(msg.get("set", -1)), int(msg["slot"]))
        if "handle" in msg:
            old = self._opened.pop(slot, None)
            if old is not None:
                old.close()
            self._opened[slot] = OpenedBuffer(msg["handle"])
        if slot not in self._opened:
            raise BucketRejected(f"bucket {manifest.seq} names slot {slot}, never announced")
        buf = self._opened[slot].tensor
        if manifest.nbytes > buf.numel():
            raise BucketRejected(f"bucket {manifest.seq} larger than its buffer")
        return buf[: manifest.nbytes]

    def close(self) -> None:
        """Close the connection and unmap the buffers."""
        super().close()
        for buf in self._opened.values():
            buf.close()
        self._opened.clear()


def build_receiver(
    options: ColocatedOptions, address: tuple[str, int], rank: int
) -> ColocatedReceiver:
    """The engine side, as ``Transport.receiver_factory`` builds it (``rank`` is 1-based)."""
    return ColocatedReceiver(options, address)
