"""Registers the ``lora`` adapter (entry point ``lora`` in the group ``miles``).

Importing this module imports no torch and no peft: the factory is a ``"module:attr"`` string.
"""

from __future__ import annotations

from collections.abc import Callable

from miles_core import Adapter, hookimpl
from miles_lora.options import LoraOptions


def adapter() -> Adapter:
    """The record of the LoRA adapter."""
    return Adapter(
        name="lora",
        factory="miles_lora.adapter:build",
        config=LoraOptions,
        description="LoRA on peft: frozen base, low-rank adapters trained and synced; the "
        "engines serve the adapter through SGLang's LoRA API",
        engine_capabilities=frozenset({"lora"}),
    )


@hookimpl
def miles_register_adapters(register: Callable[[Adapter], None]) -> None:
    """Register the ``lora`` adapter."""
    register(adapter())
