"""Miles LoRA adapter on ``peft``: the policy's base weights stay frozen, only the low-rank
adapter trains and is synced to the engines, which serve it beside the base.

Importing the package imports no torch and no peft; the adapter is built through
``miles_lora.adapter:build`` when a run selects ``adapter: {name: lora, ...}``.
"""

from miles_lora.options import LoraOptions

__all__ = ["LoraOptions"]
