"""The trainer side of the colocated transport."""

from __future__ import annotations

import torch
from miles_transport_common.bucketing import PackedBucket
from miles_transport_common.deadline import Deadline
from miles_transport_common.session import FaultHook, Finish, SocketSender

from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.handles import SharedBuffer


class ColocatedSender(SocketSender):
    """Packs buckets into ``num_buffers`` shared buffers (shared memory on CPU, CUDA IPC on
    GPU) and announces each filled one to the receivers, which read it in place.

    The handle of a buffer travels once per receiver (the first time the buffer is used); after
    that a bucket costs one small control message.
    """

    transport = "colocated"

    def __init__(self, options: ColocatedOptions, *, fault_hook: FaultHook | None = None) -> None:
        self.shared: list[SharedBuffer] = []
        self._announced: set[tuple[int, int]] = set()
        super().__init__(
            options, num_buffers=options.num_buffers, device=options.device, fault_hook=fault_hook
        )
        self.device = options.device

    def allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        """A shared buffer for ``slot``."""
        buf = SharedBuffer(nbytes, self.options.device)  # type: ignore[attr-defined]
        self.shared.append(buf)
        return buf.tensor

    def deliver(self, bucket: PackedBucket, deadline: Deadline) -> Finish:
        """Nothing moves: the receivers read the shared buffer; new receivers get its handle."""
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the packing copies must be visible
        out = []
        for i in range(len(self.conns)):
            if (i, bucket.slot) in self._announced:
                out.append({})
            else:
                self._announced.add((i, bucket.slot))
                out.append({"handle": self.shared[bucket.slot].handle})
        return lambda: out

    def close(self) -> None:
        """Close the connections and free the shared buffers."""
        super().close()
        self.packer.buffers.clear()
        for buf in self.shared:
            buf.close()
        self.shared.clear()


def build(options: ColocatedOptions) -> ColocatedSender:
    """Factory of the registered ``colocated`` transport: the sending side."""
    return ColocatedSender(options)
