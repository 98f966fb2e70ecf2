"""Registers the colocated transport with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import Transport, hookimpl
from miles_transport_colocated.config import ColocatedOptions


@hookimpl
def miles_register_transports(register: Callable[[Transport], None]) -> None:
    """Register ``colocated``: shared-memory / CUDA IPC bucket hand-off on one machine."""
    register(
        Transport(
            name="colocated",
            factory="miles_transport_colocated.sender:build",
            config=ColocatedOptions,
            description="zero-copy bucket hand-off on one machine (shared memory / CUDA IPC)",
            engine_capabilities=frozenset({"update_weights_from_tensor"}),
            # an adapter alone: SGLang's /load_lora_adapter_from_tensors, in one shared bucket
            adapter_capabilities=frozenset({"lora"}),
            requires={"placement": ["colocated"]},
        )
    )
