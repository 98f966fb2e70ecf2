"""Every transport registers the engine side too, callable as (options, address, rank)."""

from __future__ import annotations

import inspect

import pytest

from miles_core.components import Kind
from miles_core.plugins import load_plugins


@pytest.mark.parametrize("name", ["colocated", "broadcast", "p2p"])
def test_receiver_factory_is_registered(name: str) -> None:
    registry = load_plugins(allow=[f"miles-transport-{name}"]).registry
    component = registry.get(Kind.TRANSPORT, name)
    factory = component.load_receiver()
    assert list(inspect.signature(factory).parameters) == ["options", "address", "rank"]
