"""Only p2p registers an engine-side receiver: colocated and broadcast use SGLang's endpoints."""

from __future__ import annotations

import inspect

from miles_core.components import Kind
from miles_core.plugins import load_plugins


def test_engine_capabilities_and_receiver_factories() -> None:
    registry = load_plugins(
        allow=[f"miles-transport-{n}" for n in ("colocated", "broadcast", "p2p")]
    ).registry
    caps = {
        n: registry.get(Kind.TRANSPORT, n).engine_capabilities
        for n in ("colocated", "broadcast", "p2p")
    }
    assert caps == {
        "colocated": {"update_weights_from_tensor"},
        "broadcast": {"update_weights_from_distributed"},
        "p2p": {"p2p_weights"},
    }
    assert not registry.get(Kind.TRANSPORT, "colocated").receiver_factory
    assert not registry.get(Kind.TRANSPORT, "broadcast").receiver_factory
    factory = registry.get(Kind.TRANSPORT, "p2p").load_receiver()
    assert list(inspect.signature(factory).parameters) == ["options", "address", "rank"]
