"""Registers the p2p transport with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import Transport, hookimpl
from miles_transport_p2p.config import RECEIVER_ROUTE, P2POptions


@hookimpl
def miles_register_transports(register: Callable[[Transport], None]) -> None:
    """Register ``p2p``: NIXL writes into the engines' registered bucket memory."""
    register(
        Transport(
            name="p2p",
            factory="miles_transport_p2p.sender:build",
            receiver_factory="miles_transport_p2p.receiver:build_receiver",
            # the embedded engine serves the receiver here (the sender posts each update to it)
            receiver_route=RECEIVER_ROUTE,
            config=P2POptions,
            description="NIXL (UCX) writes into the engines' registered memory, bucket by bucket",
            engine_capabilities=frozenset({"p2p_weights"}),
            # an adapter alone: the engine commits the received tensors into it (lora_name)
            adapter_capabilities=frozenset({"lora", "lora_weight_updates"}),
            requires={"placement": ["disaggregated"]},
        )
    )
