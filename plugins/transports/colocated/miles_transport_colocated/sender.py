"""The trainer side of the colocated transport."""

from __future__ import annotations

from collections.abc import Callable

import torch
from miles_transport_common.bucketing import BucketPacker, PackedBucket
from miles_transport_common.deadline import Deadline
from miles_transport_common.session import FaultHook, Finish, SocketSender

from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.handles import SharedBuffer


class ColocatedSender(SocketSender):
    """Packs buckets into shared buffers (shared memory on CPU, CUDA IPC on GPU) and announces
    each filled one to the receivers, which read it in place.

    ``memory="model"``: two sets of buffers, one bucket each, used in turn by successive
    updates. The receivers keep serving from the set of the last committed update, so the next
    update is packed into the other set; the live set changes only when every receiver
    committed (a rejected update leaves them all on the old set). ``memory="bucket"``:
    ``num_buffers`` buffers reused within an update; a slot is refilled once every receiver
    acknowledged (copied out) the bucket it held.

    The handle of a buffer travels once per receiver (the first time it is used); after that a
    bucket costs one small control message.
    """

    transport = "colocated"

    def __init__(self, options: ColocatedOptions, *, fault_hook: FaultHook | None = None) -> None:
        self.shared: dict[tuple[int, int], SharedBuffer] = {}
        self._announced: set[tuple[int, int, int]] = set()
        self.live_set = 1  # the first update packs into set 0
        super().__init__(
            options, num_buffers=options.num_buffers, device=options.device, fault_hook=fault_hook
        )
        self.device = options.device
        self.copts = options
        if options.memory == "model":
            self.sets = [
                BucketPacker(
                    options.bucket_bytes,
                    num_buffers=None,
                    allocate=self._allocator(s),
                    hasher=self.hasher,
                    hash_inline=True,
                )
                for s in (0, 1)
            ]

    def _allocator(self, set_index: int) -> Callable[[int, int], torch.Tensor]:
        def allocate(slot: int, nbytes: int) -> torch.Tensor:
            buf = SharedBuffer(nbytes, self.copts.device)
            self.shared[(set_index, slot)] = buf
            return buf.tensor

        return allocate

    def allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        """A shared buffer for ``slot`` (``memory="bucket"``)."""
        return self._allocator(-1)(slot, nbytes)

    @property
    def _set(self) -> int:
        return 1 - self.live_set if self.copts.memory == "model" else -1

    def packer_for(self, version: int) -> BucketPacker:
        """``memory="model"``: the set no receiver serves from."""
        return self.sets[self._set] if self.copts.memory == "model" else self.packer

    def committed(self) -> None:
        """Every receiver serves from the set just sent: it becomes the live one."""
        if self.copts.memory == "model":
            self.live_set = 1 - self.live_set

    def deliver(self, bucket: PackedBucket, deadline: Deadline) -> Finish:
        """Nothing moves: the receivers read the shared buffer; new receivers get its handle."""
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the packing copies must be visible
        key = (self._set, bucket.slot)
        out = []
        for i in range(len(self.conns)):
            extra: dict[str, object] = {"set": key[0]}
            if (i, *key) not in self._announced:
                self._announced.add((i, *key))
                extra["handle"] = self.shared[key].handle
            out.append(extra)
        return lambda: out

    def close(self) -> None:
        """Close the connections and free the shared buffers."""
        super().close()
        self.packer.buffers.clear()
        for packer in getattr(self, "sets", []):
            packer.buffers.clear()
        for buf in self.shared.values():
            buf.close()
        self.shared.clear()


def build(options: ColocatedOptions) -> ColocatedSender:
    """Factory of the registered ``colocated`` transport: the sending side."""
    return ColocatedSender(options)
