"""A NIXL agent with its registered bucket buffers (``nixl`` is imported only here, when a p2p
endpoint is built)."""

from __future__ import annotations

import base64
import os
import uuid
from typing import Any

import torch
from miles_transport_common.errors import TransportError


def new_agent(role: str, backend: str) -> Any:
    """A NIXL agent named uniquely for this process, with only ``backend`` instantiated."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise TransportError(f"the p2p transport needs nixl==1.5.1: {exc}") from exc
    name = f"miles-p2p-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # No progress thread: on few cores its busy polling starves the packing and hashing; the
    # transport polls (check_xfer_state, get_new_notifs) whenever it waits, which progresses UCX.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[backend]))
    if backend not in agent.backends:
        raise TransportError(
            f"NIXL could not instantiate its {backend} backend (plugins found: "
            f"{agent.get_plugin_list()})"
        )
    return agent


def mem_type(t: torch.Tensor) -> str:
    """NIXL memory type of a tensor."""
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def region(t: torch.Tensor, nbytes: int | None = None) -> tuple[int, int, int]:
    """(address, length, device id) of a contiguous tensor's first ``nbytes`` bytes."""
    dev = t.get_device()
    return (t.data_ptr(), t.numel() * t.element_size() if nbytes is None else nbytes, max(dev, 0))


def b64(data: bytes) -> str:
    """Bytes as text for a JSON control message."""
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    """Inverse of :func:`b64`."""
    return base64.b64decode(text)
