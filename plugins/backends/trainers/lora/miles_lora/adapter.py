"""The LoRA adapter the trainer backend calls (``miles_core.contracts.AdapterImpl``), on peft.

``apply`` wraps a Hugging Face causal LM with ``peft.get_peft_model`` after checking every
``target_modules`` entry against the model (peft skips or only warns about an entry that
matches nothing), then draws A from a generator seeded with ``init_seed`` (B is zero, as peft
makes it), so every rank and every run starts from the same adapter whatever the run's RNG
did before. The weight streams work on the wrapped model's state dict, whose adapter tensors
are named ``<module>.lora_A.default.weight``; PEFT's files and SGLang's
``/load_lora_adapter_from_tensors`` name them ``<module>.lora_A.weight``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from miles_lora.options import LoraOptions, is_suffix

#: peft's name of the one adapter a model gets here (the infix the state dict carries)
ADAPTER = "default"
#: the wrapped model's prefix before the Hugging Face module names
PREFIX = "base_model.model."
_LORA = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.")


def _identity(t: Tensor) -> Tensor:
    return t


def matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` is selected by a ``target_modules`` entry (a suffix, or a
    regular expression matched against the whole name), as peft reads it."""
    if is_suffix(pattern):
        return name == pattern or name.endswith("." + pattern)
    return re.fullmatch(pattern, name) is not None


class LoraAdapter:
    """LoRA with :class:`~miles_lora.options.LoraOptions`; plain data, so it pickles to
    spawned ranks."""

    def __init__(self, options: LoraOptions) -> None:
        self.options = options
        self.name = options.served_name

    # --- wrapping -----------------------------------------------------------------------

    def check_targets(self, model: nn.Module) -> list[str]:
        """The names of the modules the options select; raises when an entry matches no
        module, or a module LoRA does not wrap (only Linear layers are adapted here)."""
        modules = dict(model.named_modules())
        linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        selected: list[str] = []
        for entry in self.options.target_modules:
            hits = [n for n in modules if n and matches(entry, n)]
            if not hits:
                suffixes = sorted({n.rsplit(".", 1)[-1] for n in linear})
                raise ValueError(
                    f"adapter.target_modules: {entry!r} matches no module of the model "
                    f"({type(model).__name__}); its Linear layers end in: {', '.join(suffixes)} "
                    f"(e.g. {', '.join(linear[:3])})"
                )
            wrong = [n for n in hits if not isinstance(modules[n], nn.Linear)]
            if wrong:
                raise ValueError(
                    f"adapter.target_modules: {entry!r} matches {wrong[0]!r} "
                    f"({type(modules[wrong[0]]).__name__}); LoRA adapts Linear layers only"
                )
            selected += [n for n in hits if n not in selected]
        return selected

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` of the options."""
        from peft import LoraConfig

        o = self.options
        return LoraConfig(
            r=o.rank,
            lora_alpha=o.alpha,
            lora_dropout=o.dropout,
            target_modules=o.peft_target_modules(),
            use_rslora=o.use_rslora,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` (a Hugging Face causal LM, on any device, the meta one included):
        base frozen, A seeded, B zero."""
        from peft import get_peft_model

        self.check_targets(model)
        wrapped: nn.Module = get_peft_model(model, self.peft_config())
        generator = torch.Generator().manual_seed(self.options.init_seed)
        for name, param in wrapped.named_parameters():
            param.requires_grad_(_LORA.search(name) is not None)
            if param.is_meta or _LORA.search(name) is None:
                continue
            with torch.no_grad():
                if ".lora_A." in name:
                    # peft's own initialisation (kaiming uniform, a = sqrt 5), from our stream
                    value = torch.empty(param.shape, dtype=torch.float32)
                    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
                    param.copy_(value)
                else:
                    param.zero_()
        return wrapped

    # --- weights ------------------------------------------------------------------------

    def named_weights(
        self, model: nn.Module, full: Callable[[Tensor], Tensor] | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """(PEFT name, tensor) of every adapter tensor of the wrapped ``model``."""
        gather = full or _identity
        for name, value in model.state_dict().items():
            if _LORA.search(name):
                yield _LORA.sub(r".\1.", name), gather(value)

    def merged_weights(
        self, model: nn.Module, full: Callable[[Tensor], Tensor] | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """The base model's (Hugging Face name, tensor) with ``W + scaling * B @ A`` in place
        of every adapted weight, computed in float32 and cast back to ``W``'s dtype."""
        gather = full or _identity
        scaling = self.options.scaling()
        pending: dict[str, dict[str, Tensor]] = {}
        for name, value in model.state_dict().items():
            plain = name.removeprefix(PREFIX)
            if ".base_layer." in plain or _LORA.search(plain):
                if plain.endswith(".base_layer.bias"):
                    yield plain.replace(".base_layer.", "."), gather(value)
                    continue
                module, part = _split(plain)
                parts = pending.setdefault(module, {})
                parts[part] = gather(value)
                if len(parts) == 3:
                    del pending[module]
                    w, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
                    delta = (b.float() @ a.float()) * scaling
                    yield f"{module}.weight", (w.float() + delta).to(w.dtype)
                continue
            yield plain, gather(value)
        if pending:
            raise RuntimeError(f"LoRA modules without their base weight or A/B: {list(pending)}")

    def engine_config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for these options."""
        config: dict[str, Any] = self.peft_config().to_dict()
        config["peft_type"] = "LORA"
        config["task_type"] = "CAUSAL_LM"
        config["target_modules"] = self.options.peft_target_modules()
        return json.loads(json.dumps(config, default=str))

    def save_pretrained(self, weights: Iterable[tuple[str, Tensor]], path: str) -> None:
        """``adapter_model.safetensors`` and ``adapter_config.json`` under ``path``."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in weights}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), {"format": "pt"})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self.engine_config(), f, indent=2, sort_keys=True)


def _split(name: str) -> tuple[str, str]:
    """``layers.0.q_proj.base_layer.weight`` -> (``layers.0.q_proj``, ``weight``);
    ``layers.0.q_proj.lora_A.default.weight`` -> (``layers.0.q_proj``, ``lora_A``)."""
    if ".base_layer." in name:
        return name.split(".base_layer.", 1)[0], "weight"
    found = _LORA.search(name)
    assert found is not None
    return name[: found.start()], found.group(1)


def build(options: LoraOptions | None = None) -> LoraAdapter:
    """Factory of the ``lora`` adapter."""
    return LoraAdapter(options if options is not None else LoraOptions())
