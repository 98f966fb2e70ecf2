"""Miles's colocated weight transport: bucket buffers handed to the engine process on the same
machine without copying them through a socket — shared-memory segments on CPU, CUDA IPC handles
on GPU."""

from __future__ import annotations

from miles_transport_colocated.config import ColocatedOptions

__all__ = ["ColocatedOptions"]
