"""LoRA adapters served beside the base model (SGLang's multi-adapter serving).

An adapter is a PEFT one: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and tensors named as ``peft`` saves them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Every targeted linear
``y = x W^T`` of a request served with an adapter becomes ``y + scale * (x A^T) B^T`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); dropout is a
training-time operation and is not applied.

Several adapters run in one batch: for the adapters of a batch, the A matrices of one module
are stacked along the rank (``[sum r, in]``) and the B matrices side by side (``[out, sum r]``);
``x A^T`` then holds every adapter's low-rank projection, and a per-row mask (the row's own
adapter's columns set to its scale, all others zero; all zero for a base-model row) keeps only
the row's own before ``B``. Two matrix products and one multiplication per module, whatever the
mix, and nothing at all when no row of the batch names an adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: The projections of a Llama-family decoder layer an adapter may target.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION + MLP

_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+\.(?P<kind>" + "|".join(SUPPORTED_MODULES) + r"))"
    r"\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


class LoraError(ValueError):
    """An adapter or a request naming one was refused; the message names the field."""


@dataclass
class Adapter:
    """One loaded adapter: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scale: float
    config: dict[str, Any]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    pinned: bool = False
    #: distinct per installation: a replaced adapter never shares a cached prefix with its
    #: predecessor
    generation: int = 0


def parse_lora_paths(items: Iterable[str]) -> list[tuple[str, str]]:
    """SGLang's ``--lora-paths`` entries: ``name=path`` or ``path`` (the name is the path)."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        out.append((name, path) if sep else (item, item))
    return out


def read_adapter_folder(path: str) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """``adapter_config.json`` and the tensors of a PEFT ``save_pretrained`` folder."""
    if not os.path.isdir(path):
        raise LoraError(f"lora_path: no such adapter folder: {path}")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise LoraError(f"lora_path: {path} has no adapter_config.json (not a PEFT adapter)")
    with open(cfg_file) as f:
        config = json.load(f)
    st = os.path.join(path, "adapter_model.safetensors")
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        tensors = load_file(st)
    elif os.path.isfile(bin_file):
        tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    else:
        raise LoraError(
            f"lora_path: {path} has neither adapter_model.safetensors nor adapter_model.bin"
        )
    return config, list(tensors.items())


def normalise_name(name: str) -> tuple[str, str, str] | None:
    """``(module path, module kind, "A"|"B")`` of a PEFT tensor name, with or without the
    ``base_model.model.`` prefix and the adapter-name infix (``lora_A.default.weight``);
    ``None`` for a name that is not a LoRA A/B weight of a supported projection."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m.group("module"), m.group("kind"), m.group("ab")


class LoraRegistry:
    """The loaded adapters and the serving limits (SGLang's LoRA options)."""

    def __init__(
        self,
        model: Any,
        *,
        max_lora_rank: int = 64,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int | None = None,
        target_modules: Iterable[str] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        mods = list(target_modules or ["all"])
        if "all" in mods:
            mods = list(SUPPORTED_MODULES)
        unknown = sorted(set(mods) - set(SUPPORTED_MODULES))
        if unknown:
            raise LoraError(
                f"lora_target_modules: {unknown} not supported; allowed: "
                f"{', '.join(SUPPORTED_MODULES)} or 'all'"
            )
        self.target_modules = tuple(m for m in SUPPORTED_MODULES if m in mods)
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        #: (layer, kind) -> (in_features, out_features) of the base linear
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        for name, mod in model.named_modules():
            m = _LAYER.match(name)
            if m and isinstance(mod, torch.nn.Linear) and m.group(2) in SUPPORTED_MODULES:
                self.shapes[(int(m.group(1)), m.group(2))] = (mod.in_features, mod.out_features)
        self.adapters: dict[str, Adapter] = {}
        self.paths: dict[str, str] = {}
        self._generation = 0
        self._stacks: OrderedDict[tuple[str, ...], _Stack] = OrderedDict()

    # --- adapters -----------------------------------------------------------------------------

    def build(
        self,
        name: str,
        config: Mapping[str, Any],
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        path: str = "__tensor__",
        pinned: bool = False,
    ) -> Adapter:
        """Check an adapter in full and return it (nothing is installed)."""
        if not isinstance(config, Mapping):
            raise LoraError("config_dict: must be the adapter_config.json object")
        if not name:
            raise LoraError("lora_name: must be a non-empty string")
        rank, scale = self._rank_and_scale(config)
        return Adapter(
            name=name,
            path=path,
            rank=rank,
            scale=float(scale),
            config=dict(config),
            weights=self._weights(self._pairs(named), rank),
            pinned=pinned,
        )

    def _rank_and_scale(self, config: Mapping[str, Any]) -> tuple[int, float]:
        """The adapter's rank and scale, from a config whose every field is served."""
        ptype = str(config.get("peft_type", "LORA")).upper()
        if ptype != "LORA":
            raise LoraError(f"config_dict.peft_type: {ptype!r} is not served; allowed: 'LORA'")
        rank = config.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise LoraError(f"config_dict.r: must be a positive integer, got {rank!r}")
        if rank > self.max_lora_rank:
            raise LoraError(
                f"config_dict.r: rank {rank} exceeds the server's max_lora_rank "
                f"({self.max_lora_rank}); allowed: 1..{self.max_lora_rank}"
            )
        alpha = config.get("lora_alpha", rank)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise LoraError(f"config_dict.lora_alpha: must be a number, got {alpha!r}")
        for key, allowed in (("use_dora", False), ("bias", "none")):
            if config.get(key, allowed) not in (allowed, None):
                raise LoraError(
                    f"config_dict.{key}: {config.get(key)!r} is not served; allowed: {allowed!r}"
                )
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
            if config.get(key):
                raise LoraError(f"config_dict.{key}: not served; allowed: empty or null")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return rank, scale

    def _pairs(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
        """The given A and B tensors by (layer, module), each name checked against the base
        model and the served modules."""
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for tname, t in named:
            parsed = normalise_name(tname)
            if parsed is None:
                raise LoraError(
                    f"tensor {tname!r}: not a LoRA A/B weight of a supported projection "
                    f"({', '.join(SUPPORTED_MODULES)})"
                )
            module, kind, ab = parsed
            m = _LAYER.match(module)
            if m is None or (int(m.group(1)), kind) not in self.shapes:
                raise LoraError(f"tensor {tname!r}: the base model has no module {module!r}")
            where = (int(m.group(1)), kind)
            if kind not in self.target_modules:
                raise LoraError(
                    f"tensor {tname!r}: module {kind!r} is outside the server's "
                    f"lora_target_modules; allowed: {', '.join(self.target_modules)}"
                )
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise LoraError(f"tensor {tname!r}: must be a 2-D tensor")
            slot = pairs.setdefault(where, {})
            if ab in slot:
                raise LoraError(f"tensor {tname!r}: given twice for module {module!r}")
            slot[ab] = t
        if not pairs:
            raise LoraError("serialized tensors: the adapter has no LoRA A/B weight")
        return pairs

    def _weights(
        self, pairs: dict[tuple[int, str], dict[str, torch.Tensor]], rank: int
    ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Each module's (A, B), checked whole and shaped for its base linear at ``rank``,
        copied to the served device and dtype."""
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, kind), slot in sorted(pairs.items()):
            path_ = f"model.layers.{layer}.{'self_attn' if kind in ATTENTION else 'mlp'}.{kind}"
            if set(slot) != {"A", "B"}:
                missing = "lora_B" if "A" in slot else "lora_A"
                raise LoraError(f"module {path_!r}: {missing} is missing")
            a, b = slot["A"], slot["B"]
            fan_in, fan_out = self.shapes[(layer, kind)]
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                raise LoraError(
                    f"module {path_!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                    f"do not fit the base linear ({fan_in} -> {fan_out}) at r={rank}; "
                    f"expected lora_A ({rank}, {fan_in}) and lora_B ({fan_out}, {rank}) "
                    "(an adapter of another base model?)"
                )
            weights[(layer, kind)] = (
                a.detach().to(self.device, self.dtype).contiguous().clone(),
                b.detach().to(self.device, self.dtype).contiguous().clone(),
            )
        return weights

    def install(self, adapter: Adapter) -> None:
        """Install (or replace) an adapter already checked by :meth:`build`."""
        if (
            adapter.name not in self.adapters
            and self.max_loaded_loras is not None
            and len(self.adapters) >= self.max_loaded_loras
        ):
            raise LoraError(
                f"max_loaded_loras: {len(self.adapters)} adapters are loaded, the most this "
                f"server holds ({self.max_loaded_loras}); unload one first"
            )
        self._generation += 1
        adapter.generation = self._generation
        self.adapters[adapter.name] = adapter
        self.paths[adapter.name] = adapter.path
        self._stacks.clear()

    def remove(self, name: str) -> None:
        """Drop an adapter (a missing one is a :class:`LoraError` naming it)."""
        if name not in self.adapters:
            raise LoraError(self.not_loaded(name))
        del self.adapters[name]
        del self.paths[name]
        self._stacks.clear()

    def not_loaded(self, name: str) -> str:
        """The message for a name that is not loaded."""
        loaded = ", ".join(sorted(self.adapters)) or "none"
        return f"LoRA adapter {name!r} is not loaded (loaded: {loaded})"

    def generation(self, name: str | None) -> int:
        """The installation number of ``name`` (0 for the base model)."""
        return 0 if name is None else self.adapters[name].generation

    # --- batches ------------------------------------------------------------------------------

    def batch(self, names: list[str | None]) -> LoraBatch | None:
        """The per-row deltas of a batch whose row ``i`` uses adapter ``names[i]`` (None: the
        base model); None when no row uses one (the base forward runs unchanged)."""
        used = sorted({n for n in names if n is not None})
        if not used:
            return None
        key = tuple(used)
        stack = self._stacks.get(key)
        if stack is None:
            stack = _Stack([self.adapters[n] for n in used], self.dtype, self.device)
            self._stacks[key] = stack
            while len(self._stacks) > 8:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(key)
        return stack.batch(names)


@dataclass
class _Stack:
    """The stacked weights of one set of adapters."""

    adapters: list[Adapter]
    dtype: torch.dtype
    device: torch.device
    #: (layer, kind) -> (A stacked [C, in], B side by side [out, C])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(init=False)
    #: adapter name -> its columns [start, end)
    columns: dict[str, tuple[int, int]] = field(init=False)
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.columns, start = {}, 0
        for a in self.adapters:
            self.columns[a.name] = (start, start + a.rank)
            start += a.rank
        self.width = start
        keys = sorted({k for a in self.adapters for k in a.weights})
        self.weights = {}
        for key in keys:
            fan_in = fan_out = 0
            for a in self.adapters:
                if key in a.weights:
                    fan_in, fan_out = a.weights[key][0].shape[1], a.weights[key][1].shape[0]
            big_a = torch.zeros(self.width, fan_in, dtype=self.dtype, device=self.device)
            big_b = torch.zeros(fan_out, self.width, dtype=self.dtype, device=self.device)
            for a in self.adapters:
                if key in a.weights:
                    s, e = self.columns[a.name]
                    big_a[s:e] = a.weights[key][0]
                    big_b[:, s:e] = a.weights[key][1]
            self.weights[key] = (big_a, big_b)

    def batch(self, names: list[str | None]) -> LoraBatch:
        mask = torch.zeros(len(names), 1, self.width, dtype=self.dtype)
        scales = {a.name: a.scale for a in self.adapters}
        for i, n in enumerate(names):
            if n is not None:
                s, e = self.columns[n]
                mask[i, 0, s:e] = scales[n]
        return LoraBatch(self.weights, mask.to(self.device))


class LoraBatch:
    """The adapters' deltas for one forward: ``add(layer, kind, x, y)`` returns ``y`` plus each
    row's own adapter delta of module ``kind`` of ``layer`` applied to ``x``."""

    def __init__(
        self, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
    ) -> None:
        self.weights = weights
        self.mask = mask  # [rows, 1, C]: the row's adapter's columns at its scale, others 0

    def add(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y + ((x A^T) * mask) B^T`` for the module, or ``y`` when no adapter targets it."""
        ab = self.weights.get((layer, kind))
        if ab is None:
            return y
        t = F.linear(x, ab[0]) * self.mask
        return y + F.linear(t, ab[1])
