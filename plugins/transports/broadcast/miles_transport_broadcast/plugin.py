"""Registers the broadcast transport with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import Transport, hookimpl
from miles_transport_broadcast.config import BroadcastOptions


@hookimpl
def miles_register_transports(register: Callable[[Transport], None]) -> None:
    """Register ``broadcast``: a gloo/NCCL group from the trainer's sending rank to the engines."""
    register(
        Transport(
            name="broadcast",
            factory="miles_transport_broadcast.sender:build",
            config=BroadcastOptions,
            description="torch.distributed broadcast in bounded buckets (gloo on CPU, NCCL on GPU)",
            engine_capabilities=frozenset({"update_weights_from_distributed"}),
            # an adapter alone: the engine commits the broadcast tensors into it (lora_name)
            adapter_capabilities=frozenset({"lora", "lora_weight_updates"}),
            requires={"placement": ["disaggregated"]},
        )
    )
