"""Miles's broadcast weight transport: a torch.distributed group (gloo on CPU, NCCL on GPU)
spanning the trainer's sending rank and every engine, fed bucket by bucket."""

from __future__ import annotations

from miles_transport_broadcast.config import BroadcastOptions

__all__ = ["BroadcastOptions"]
