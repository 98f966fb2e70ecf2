"""Sharing a bucket buffer between processes of one machine without copying it.

CPU: a POSIX shared-memory segment (``multiprocessing.shared_memory``) wrapped as a uint8
tensor; the handle is the segment's name. CUDA: the buffer's CUDA IPC handle, produced and
opened by torch's own reductions (the pickled rebuild call, base64 in the control message;
only a trusted local peer ever sees it).
"""

from __future__ import annotations

import base64
import pickle
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch


class SharedBuffer:
    """A bucket buffer the sender owns and shares (created by the sender, freed by it)."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.device = device
        self._shm: shared_memory.SharedMemory | None = None
        if device == "cpu":
            self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            self.handle: dict[str, Any] = {"kind": "shm", "name": self._shm.name, "size": nbytes}
        else:
            from torch.multiprocessing.reductions import reduce_tensor

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            rebuild, args = reduce_tensor(self.tensor)
            blob = base64.b64encode(pickle.dumps((rebuild, args))).decode()
            self.handle = {"kind": "cuda_ipc", "blob": blob, "size": nbytes}

    def close(self) -> None:
        """Release the buffer (unlinks the segment; receivers' mappings stay valid until they
        close them)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


class OpenedBuffer:
    """A receiver's mapping of a sender's :class:`SharedBuffer`."""

    def __init__(self, handle: dict[str, Any]) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        if handle["kind"] == "shm":
            self._shm = shared_memory.SharedMemory(name=handle["name"])
            # Attaching registers the segment with this process's resource tracker, which would
            # unlink it at exit although the sender owns it.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=handle["size"])
        elif handle["kind"] == "cuda_ipc":
            rebuild, args = pickle.loads(base64.b64decode(handle["blob"]))
            self.tensor = rebuild(*args)
        else:
            raise ValueError(f"unknown buffer handle kind {handle['kind']!r}")

    def close(self) -> None:
        """Unmap the buffer."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process
            self._shm = None
