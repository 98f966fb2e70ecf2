"""The LoRA adapter the trainer backend calls (``miles_core.contracts.AdapterImpl``), on peft.

``apply`` wraps a Hugging Face causal LM with ``peft.get_peft_model`` after checking every
``target_modules`` entry against the model (peft skips or only warns about an entry that
matches nothing), then draws A from a generator seeded with ``init_seed`` (B is zero, as peft
makes it), so every rank and every run starts from the same adapter whatever the run's RNG
did before. ``add_to`` adds a further adapter to a model ``apply`` wrapped (several adapters
on one base: multi-LoRA), the same way. peft's adapter name is the served name, so the
weight streams work on the wrapped model's state dict, whose tensors of this adapter are
named ``<module>.lora_A.<served_name>.weight``; PEFT's files and SGLang's
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

from miles_core.contracts import each_tensor_once
from miles_lora.options import LoraOptions, is_suffix

#: the wrapped model's prefix before the Hugging Face module names
PREFIX = "base_model.model."
#: the tensors of any adapter of a wrapped model (group 2: peft's adapter name)
_ANY_LORA = re.compile(r"\.(lora_[AB])\.([^.]+)\.")


def _infix(name: str) -> re.Pattern[str]:
    """The state-dict infix of adapter ``name``'s tensors (group 1: ``lora_A``/``lora_B``)."""
    return re.compile(rf"\.(lora_[AB])\.{re.escape(name)}\.")


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
        #: the served name, which is also peft's adapter name in the wrapped model
        self.name = options.served_name
        self._lora = _infix(self.name)

    @property
    def lr(self) -> float | None:
        """This adapter's own learning rate (``None``: the trainer backend's)."""
        return self.options.lr

    # --- wrapping -----------------------------------------------------------------------

    def check_targets(self, model: nn.Module) -> list[str]:
        """The names of the modules the options select; raises when an entry matches no
        module, or a module LoRA does not wrap (only Linear layers are adapted here)."""
        modules = _plain_modules(model)
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

    def entries_selecting(self, name: str) -> list[str]:
        """The ``target_modules`` entries that select the module ``name``."""
        return [e for e in self.options.target_modules if matches(e, name)]

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
        base frozen, A seeded, B zero; peft's adapter name is :attr:`name`."""
        from peft import get_peft_model

        self.check_targets(model)
        wrapped: nn.Module = get_peft_model(model, self.peft_config(), adapter_name=self.name)
        for _, param in wrapped.named_parameters():
            param.requires_grad_(False)
        self._initialise(wrapped)
        return wrapped

    def add_to(self, wrapped: nn.Module) -> nn.Module:
        """Add this adapter to a model another adapter's :meth:`apply` wrapped (the same
        checks, A seeded from this adapter's ``init_seed``, B zero); the base stays frozen,
        the adapters already there are left as they are (values and ``requires_grad``), and
        the active adapter does not change. Returns ``wrapped``."""
        from peft import PeftModel

        if not isinstance(wrapped, PeftModel):
            raise TypeError(
                f"add_to: {type(wrapped).__name__} is not a peft model; wrap the model with "
                "the first adapter's apply() first"
            )
        if self.name in wrapped.peft_config:
            raise ValueError(
                f"adapter.served_name {self.name!r}: the model already holds an adapter of "
                f"that name (it holds {', '.join(wrapped.peft_config)}); each adapter needs "
                "its own served_name"
            )
        self.check_targets(wrapped.get_base_model())
        before = {n: p.requires_grad for n, p in wrapped.named_parameters()}
        wrapped.add_adapter(self.name, self.peft_config())
        # peft's add_adapter re-applies the active adapter's requires_grad to every layer:
        # put back what the other adapters had.
        for name, param in wrapped.named_parameters():
            if name in before:
                param.requires_grad_(before[name])
        self._initialise(wrapped)
        return wrapped

    def _initialise(self, wrapped: nn.Module) -> None:
        """A from ``init_seed``'s stream (peft's kaiming uniform), B zero, both trainable
        (values skipped on the meta device)."""
        for _, param in self.parameters(wrapped):
            param.requires_grad_(True)
        params = [(n, p) for n, p in self.parameters(wrapped) if not p.is_meta]
        a_values = self.initial_a(
            (n, (int(p.shape[0]), int(p.shape[1]))) for n, p in params if ".lora_A." in n
        )
        with torch.no_grad():
            for name, param in params:
                if ".lora_A." in name:
                    param.copy_(a_values[name])
                else:
                    param.zero_()

    def initial_a(self, shapes: Iterable[tuple[str, tuple[int, int]]]) -> dict[str, Tensor]:
        """The initial A (float32, ``[rank, in]``) of each ``(key, shape)``, drawn in the
        given order from ``init_seed``'s stream with peft's kaiming uniform (a = sqrt 5).
        Given every adapted module of a Hugging Face model in the model's order (the order
        :meth:`apply` draws them in), it is the A :meth:`apply` gives that model: a backend
        that does not wrap the Hugging Face model (Megatron) starts from the same adapter."""
        generator = torch.Generator().manual_seed(self.options.init_seed)
        out: dict[str, Tensor] = {}
        for key, shape in shapes:
            value = torch.empty(shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
            out[key] = value
        return out

    def peft_name(self, module: str, part: str) -> str:
        """PEFT's name (as :meth:`named_weights` yields it) of ``part`` (``lora_A`` or
        ``lora_B``) of the Hugging Face module ``module`` (``model.layers.0.self_attn.q_proj``)."""
        return f"{PREFIX}{module}.{part}.weight"

    def parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """This adapter's (name, parameter) pairs of the wrapped ``model``, nothing of the
        base or of another adapter: what its optimizer steps."""
        return [(n, p) for n, p in model.named_parameters() if self._lora.search(n)]

    def activate(self, model: nn.Module) -> None:
        """Make this adapter the one the wrapped ``model``'s forward applies. peft's
        ``set_adapter`` also freezes the other adapters: their ``requires_grad`` is put
        back, so every adapter of the model stays trainable (an inactive one only gets no
        gradient) and the base stays frozen."""
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        peft_model: Any = model
        peft_model.set_adapter(self.name)
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])

    # --- weights ------------------------------------------------------------------------

    def named_weights(
        self, model: nn.Module, full: Callable[[Tensor], Tensor] | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """(PEFT name, tensor) of every tensor of this adapter in the wrapped ``model`` (other
        adapters' are left out)."""
        gather = full or _identity
        for name, value in model.state_dict().items():
            if self._lora.search(name):
                yield self._lora.sub(r".\1.", name), gather(value)

    def merged_weights(
        self, model: nn.Module, full: Callable[[Tensor], Tensor] | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """The base model's (Hugging Face name, tensor) with ``W + scaling * B @ A`` of this
        adapter in place of every weight it adapts, computed in float32 and cast back to
        ``W``'s dtype; the other adapters of the model are left out (a module only they adapt
        is the base's)."""
        gather = full or _identity
        scaling = self.options.scaling()
        mine = {
            n.removeprefix(PREFIX)
            for n, m in model.named_modules()
            if self.name in getattr(m, "lora_A", {})
        }
        pending: dict[str, dict[str, Tensor]] = {}
        for name, param in each_tensor_once(model.state_dict(keep_vars=True)):
            value = param.detach()
            plain = name.removeprefix(PREFIX)
            other = _ANY_LORA.search(plain)
            if other and other.group(2) != self.name:
                continue
            if ".base_layer." in plain or other:
                if plain.endswith(".base_layer.bias"):
                    yield plain.replace(".base_layer.", "."), gather(value)
                    continue
                module, part = self._split(plain)
                if module not in mine:
                    yield f"{module}.{part}", gather(value)
                    continue
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

    def _split(self, name: str) -> tuple[str, str]:
        """``layers.0.q_proj.base_layer.weight`` -> (``layers.0.q_proj``, ``weight``);
        ``layers.0.q_proj.lora_A.<name>.weight`` -> (``layers.0.q_proj``, ``lora_A``)."""
        if ".base_layer." in name:
            return name.split(".base_layer.", 1)[0], "weight"
        found = self._lora.search(name)
        assert found is not None
        return name[: found.start()], found.group(1)


def _plain_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s modules by name as before any adapter wrapped it: a peft LoRA layer stands
    for the layer it wraps (its ``base_layer``), and what peft added inside it is left out."""
    out: dict[str, nn.Module] = {}
    tuned: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in tuned):
            continue
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module) and hasattr(module, "lora_A"):
            tuned.append(name)
            module = base
        out[name] = module
    return out


def build(options: LoraOptions | None = None) -> LoraAdapter:
    """Factory of the ``lora`` adapter."""
    return LoraAdapter(options if options is not None else LoraOptions())
