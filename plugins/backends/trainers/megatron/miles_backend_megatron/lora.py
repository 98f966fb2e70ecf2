"""LoRA on Megatron's tensor-parallel linears, from the ``lora`` adapter's options
(``miles_lora.LoraAdapter``: rank, alpha, target modules in Hugging Face names, seeded A).

Each adapted Hugging Face projection becomes a branch ``W x + scaling * B A x`` on the Megatron
linear that holds it, sharded like the base weight:

* ``q_proj``/``k_proj``/``v_proj`` -> ``linear_qkv`` and ``gate_proj``/``up_proj`` ->
  ``linear_fc1`` (column parallel): A whole on every tensor-parallel rank, B split along its
  output rows exactly as the base rows are (rank ``r`` holds the rows of its key/value groups,
  of its part of the MLP). ``A x`` goes through ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward), so A's gradient and the input's gradient through
  the branch are whole, and equal, on every rank. The three attention branches' outputs are
  placed in the grouped layout :func:`~miles_backend_megatron.bridge.fuse_qkv` gives the
  weight rows (per group: its queries, its key, its value); gate and up as ``[gate_r; up_r]``.
* ``o_proj`` -> ``linear_proj`` and ``down_proj`` -> ``linear_fc2`` (row parallel): A split
  along its input as the base weight is, its partial product summed over the group by
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward) before
  B, which is whole on every rank.

The branches are submodules of the linear they adapt, one set per adapter
(``<linear>.lora.branches.<adapter>.<proj>.lora_A`` / ``lora_B``; several adapters on one
base: multi-LoRA); a forward hook adds the output of the active adapter's branches to the
linear's (:func:`activate`; :func:`disabled` turns them all off: the base). Embeddings and the
vocabulary head are not adapted here (refused naming the module).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from miles_backend_megatron.shape import ModelShape

#: Hugging Face projection -> (the Megatron linear holding it, under the decoder layer; its
#: tensor-parallel kind)
TARGETS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.k_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.v_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.o_proj": ("self_attention.linear_proj", "row"),
    "mlp.gate_proj": ("mlp.linear_fc1", "column"),
    "mlp.up_proj": ("mlp.linear_fc1", "column"),
    "mlp.down_proj": ("mlp.linear_fc2", "row"),
}
_LAYER_MODULE = re.compile(r"^model\.layers\.(\d+)\.(" + "|".join(map(re.escape, TARGETS)) + r")$")
#: a LoRA parameter of the Megatron model (group 1: its linear, group 2: its adapter's name,
#: group 3: A or B); adapter names are served names (letters, digits, '_', '-')
LORA_PARAM = re.compile(
    r"\.(linear_qkv|linear_fc1|linear_proj|linear_fc2)\.lora\.branches\.([A-Za-z0-9_-]+)"
    r"\.[a-z_]+\.(lora_[AB])$"
)


def lora_split(name: str) -> str | None:
    """How the LoRA parameter ``name`` is split over tensor-parallel ranks (``column``: along
    its rows, ``row``: along its columns, ``replicated``); None when ``name`` is not one."""
    found = LORA_PARAM.search(name)
    if found is None:
        return None
    column = found.group(1) in ("linear_qkv", "linear_fc1")
    if found.group(3) == "lora_A":
        return "replicated" if column else "row"
    return "column" if column else "replicated"


def lora_adapter(name: str) -> str | None:
    """The name of the adapter the LoRA parameter ``name`` belongs to; None when ``name`` is
    not one."""
    found = LORA_PARAM.search(name)
    return None if found is None else found.group(2)


@dataclass(frozen=True)
class Target:
    """One adapted Hugging Face projection."""

    module: str  # model.layers.3.self_attn.q_proj
    layer: int
    proj: str  # self_attn.q_proj
    in_features: int
    out_features: int

    @property
    def key(self) -> str:
        """Its branch's key under the Megatron linear (``q_proj``)."""
        return self.proj.split(".")[-1]


def plan(adapter: Any, model_path: str) -> list[Target]:
    """The projections ``adapter``'s ``target_modules`` select in the Hugging Face model at
    ``model_path``, in the model's module order (the order the adapter draws A in). Built on
    the meta device; the adapter's own ``check_targets`` refuses an entry that matches nothing
    or a module that is not Linear; a Linear this backend does not adapt (``lm_head``) is
    refused here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    selected = set(adapter.check_targets(model))
    out: list[Target] = []
    for name, module in model.named_modules():
        if name not in selected:
            continue
        found = _LAYER_MODULE.match(name)
        if found is None:
            entries = adapter.entries_selecting(name)
            raise ValueError(
                f"adapter.target_modules: {', '.join(map(repr, entries))} selects {name!r}, "
                "which the megatron backend does not adapt; it adapts the decoder layers' "
                "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
            )
        assert isinstance(module, nn.Linear)
        out.append(
            Target(
                module=name,
                layer=int(found.group(1)),
                proj=found.group(2),
                in_features=module.in_features,
                out_features=module.out_features,
            )
        )
    return out


class LoraBranch(nn.Module):
    """One projection's A ``[r, in]`` and B ``[out, r]`` (this rank's parts)."""

    def __init__(self, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)


class LoraBranches(nn.Module):
    """The branches of one Megatron linear (``kind``: ``qkv``, ``fc1``, ``row``), one set per
    adapter (``branches[<adapter>][<proj>]``), and the local output layout they fill.
    ``active``: the adapter whose branches apply; None (or an adapter with no branch here):
    the linear is the base one."""

    def __init__(self, kind: str, widths: dict[str, int], groups: int) -> None:
        super().__init__()
        self.kind = kind
        #: each projection's local output width (key -> width), in the order of the layout
        self.widths = widths
        self.groups = groups  # the local key/value groups (qkv)
        #: each adapter's factor (alpha / r), by its name
        self.scaling: dict[str, float] = {}
        self.branches = nn.ModuleDict()
        self.active: str | None = None

    def add(self, adapter: str, key: str, branch: LoraBranch, scaling: float) -> None:
        """Add ``adapter``'s branch of projection ``key``."""
        if adapter not in self.branches:
            self.branches[adapter] = nn.ModuleDict()
            self.scaling[adapter] = scaling
        own: Any = self.branches[adapter]
        own[key] = branch

    def applies(self) -> bool:
        """Whether a branch adds to the linear's output now."""
        return self.active is not None and self.active in self.branches

    def _partial(self, own: Any, key: str, x: Tensor) -> Tensor | None:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if key not in own:
            return None
        branch: Any = own[key]
        ax = x @ branch.lora_A.t()
        if self.kind == "row":
            ax = reduce_from_tensor_model_parallel_region(ax)
        else:
            ax = copy_to_tensor_model_parallel_region(ax)
        out: Tensor = ax @ branch.lora_B.t()
        return out

    def forward(self, x: Tensor) -> Tensor:
        """The active adapter's delta for input ``x`` (see :meth:`applies`)."""
        assert self.active is not None
        own = self.branches[self.active]
        outs = []
        for key, width in self.widths.items():
            part = self._partial(own, key, x)
            if part is None:
                part = x.new_zeros(*x.shape[:-1], width)
            outs.append(part)
        if self.kind == "qkv":
            # per key/value group: its query heads, its key, its value (fuse_qkv's rows)
            lead = x.shape[:-1]
            grouped = [o.reshape(*lead, self.groups, -1) for o in outs]
            delta = torch.cat(grouped, dim=-1).reshape(*lead, -1)
        else:
            delta = torch.cat(outs, dim=-1)
        return delta * self.scaling[self.active]


def _hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    lora: Any = module.lora
    if not lora.applies():
        return None
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + lora(x), bias


def check_name(name: str) -> None:
    """Refuse an adapter name that cannot key the branches' ``ModuleDict``: one that is an
    attribute of it (``keys``, ``train``...) or holds a '.'."""
    if "." in name or not name or hasattr(nn.ModuleDict(), name):
        raise ValueError(
            f"adapter.served_name {name!r}: the megatron backend keys each adapter's LoRA "
            "branches by its name, which must not be empty, hold a '.', or name an attribute "
            "of torch's ModuleDict (keys, items, values, update, train, eval...); rename it"
        )


def attach(
    model: nn.Module,
    adapter: Any,
    targets: list[Target],
    shape: ModelShape,
    tp_rank: int,
    tp: int,
    layers: range,
    device: torch.device,
) -> list[tuple[str, nn.Parameter]]:
    """Add ``adapter``'s branches of ``targets`` on this stage (global ``layers``) to
    ``model``: A from the adapter's seeded stream (drawn for every target, so every stage and
    rank takes its part of the same adapter), B zero; returns its (name, parameter) pairs on
    this rank, trainable (none on a stage its targets leave alone). No branch applies until
    :func:`activate` picks an adapter."""
    check_name(adapter.name)
    rank = adapter.options.rank
    scaling = adapter.options.scaling()
    initial = adapter.initial_a((t.module, (rank, t.in_features)) for t in targets)
    inner: Any = getattr(model, "module", model)
    g, d = shape.groups // tp, shape.head_dim
    layouts = {
        "self_attention.linear_qkv": (
            "qkv",
            {"q_proj": g * shape.heads_per_group * d, "k_proj": g * d, "v_proj": g * d},
        ),
        "mlp.linear_fc1": ("fc1", {"gate_proj": shape.ffn // tp, "up_proj": shape.ffn // tp}),
        "self_attention.linear_proj": ("row", {"o_proj": shape.hidden}),
        "mlp.linear_fc2": ("row", {"down_proj": shape.hidden}),
    }
    for t in targets:
        if t.layer not in layers:
            continue
        local = t.layer - layers.start
        path, split = TARGETS[t.proj]
        linear = inner.decoder.layers[local].get_submodule(path)
        branches = getattr(linear, "lora", None)
        if branches is None:
            kind, widths = layouts[path]
            branches = LoraBranches(kind, widths, g)
            linear.lora = branches
            linear.register_forward_hook(_hook, with_kwargs=True)
        a = initial[t.module]
        b = torch.zeros(t.out_features, rank)
        if split == "row":
            a = a.chunk(tp, dim=1)[tp_rank]
        else:
            b = b.chunk(tp, dim=0)[tp_rank]
        branch = LoraBranch(a.clone().to(device), b.clone().to(device))
        branches.add(adapter.name, t.key, branch, scaling)
    return [(n, p) for n, p in model.named_parameters() if lora_adapter(n) == adapter.name]


def megatron_names(t: Target, layers: range, adapter: str) -> tuple[str, str]:
    """The Megatron names of ``adapter``'s A and B of ``t`` on the stage holding global
    ``layers``."""
    path, _ = TARGETS[t.proj]
    base = f"decoder.layers.{t.layer - layers.start}.{path}.lora.branches.{adapter}.{t.key}"
    return base + ".lora_A", base + ".lora_B"


def activate(model: nn.Module, adapter: str) -> None:
    """Adapter ``adapter``'s branches apply in ``model``'s forward, no other's (a linear
    without a branch of it is the base one)."""
    for m in model.modules():
        if isinstance(m, LoraBranches):
            m.active = adapter


@contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """``model`` as its base (every adapter's branches off) inside the block: the reference
    policy."""
    branches = [m for m in model.modules() if isinstance(m, LoraBranches)]
    saved = [m.active for m in branches]
    for m in branches:
        m.active = None
    try:
        yield
    finally:
        for m, active in zip(branches, saved, strict=True):
            m.active = active


def lora_layer_spec(layer_spec: str, device: torch.device) -> str:
    """The layer spec of a model with LoRA branches: Megatron's local one. Transformer
    Engine's fuses the norm into ``linear_qkv``/``linear_fc1``, whose input is then the
    un-normalised hidden state the branches cannot take: ``auto`` picks ``local``, an explicit
    ``transformer_engine`` is refused."""
    if layer_spec == "transformer_engine":
        raise ValueError(
            "backend.layer_spec 'transformer_engine' cannot carry an adapter (its fused "
            "norm+linear hides the normalised input LoRA needs); use 'local' or 'auto' "
            f"(device {device.type})"
        )
    return "local"
