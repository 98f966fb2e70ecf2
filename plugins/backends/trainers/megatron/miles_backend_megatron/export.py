"""A Megatron policy's weights as Hugging Face (or PEFT) tensors, whole: tensor-parallel parts
gathered a decoder layer at a time, a later pipeline stage's tensors sent to rank 0 one at a
time by that stage's first rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles_backend_megatron import lora
from miles_backend_megatron.bridge import hf_stage, split_of, stage_hf_names, stage_layers, unshard
from miles_backend_megatron.model import spec_name
from miles_backend_megatron.pipeline import Layout
from miles_backend_megatron.shape import ModelShape, hf_shapes

Pairs = Iterator[tuple[str, Tensor]]
Names = list[tuple[str, tuple[int, ...]]]


class StageExport:
    """The export of one rank's policy ``model`` (of ``shape``, split as ``layout`` says),
    with each adapter's adapted projections ``targets`` (by the adapter's name)."""

    def __init__(
        self,
        layout: Layout,
        shape: ModelShape,
        model: nn.Module,
        targets: dict[str, list[Any]],
        export_dtype: str | None,
    ) -> None:
        self.layout, self.shape, self.model, self.targets = layout, shape, model, targets
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(export_dtype or "")

    def _whole(self, params: dict[str, Tensor], name: str) -> Tensor:
        """The whole Megatron tensor ``name``, gathered from the tensor-parallel ranks."""
        local = params[spec_name(name, params)].detach()
        tp = self.layout.tp
        if tp == 1 or split_of(name) == "replicated":
            return local
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=self.layout.tp_group)
        return unshard(parts, split_of(name))

    def stages(
        self, produce: Callable[[int], Pairs], names: Callable[[int], Names], device: str | None
    ) -> Pairs:
        """Collective: the (name, whole tensor) pairs ``produce(stage)`` gives on each stage's
        ranks, stage after stage, yielded on rank 0 (the other ranks yield ``names(stage)``
        with empty placeholders, in step). In the options' ``export_dtype``, on ``device``."""
        layout, placeholder = self.layout, torch.empty(0)

        def out(tensor: Tensor) -> Tensor:
            # A consumer that keeps the tensor must not see it change at the next step.
            t = tensor.detach().clone()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            return t.to(device) if device is not None else t

        for stage in range(layout.pp):
            owner = layout.stage_owner(stage)
            if stage == layout.pp_rank:
                for name, tensor in produce(stage):
                    if stage > 0 and layout.rank == owner:
                        dist.send(tensor.detach().contiguous(), dst=0)
                    yield name, out(tensor)
            elif layout.rank == 0:
                for name, shape in names(stage):
                    tensor = torch.empty(shape, device=layout.device)
                    dist.recv(tensor, src=owner)
                    yield name, out(tensor)
            else:
                for name, _ in names(stage):
                    yield name, placeholder

    def base_names(self, stage: int) -> Names:
        shapes = hf_shapes(self.shape)
        names = stage_hf_names(self.shape, stage, self.layout.pp)
        return [(n, tuple(shapes[n])) for n in names]

    def base_stage(self, stage: int) -> Pairs:
        """This stage's Hugging Face tensors, whole."""
        params = dict(self.model.state_dict(keep_vars=True))
        yield from hf_stage(lambda n: self._whole(params, n), self.shape, stage, self.layout.pp)

    def lora_names(self, adapter: Any, stage: int) -> Names:
        """PEFT's (name, shape) of ``adapter``'s tensors on ``stage``, in the Hugging Face
        model's order (per module: A, then B)."""
        r = adapter.options.rank
        layers = stage_layers(self.shape, stage, self.layout.pp)
        out: Names = []
        for t in self.targets[adapter.name]:
            if t.layer in layers:
                out.append((adapter.peft_name(t.module, "lora_A"), (r, t.in_features)))
                out.append((adapter.peft_name(t.module, "lora_B"), (t.out_features, r)))
        return out

    def lora_stage(self, adapter: Any, stage: int) -> Pairs:
        """This stage's tensors of ``adapter``, whole, in PEFT's names (:meth:`lora_names`)."""
        params = dict(self.model.state_dict(keep_vars=True))
        layers = stage_layers(self.shape, stage, self.layout.pp)
        for t in self.targets[adapter.name]:
            if t.layer in layers:
                a, b = lora.megatron_names(t, layers, adapter.name)
                yield adapter.peft_name(t.module, "lora_A"), self._whole(params, a)
                yield adapter.peft_name(t.module, "lora_B"), self._whole(params, b)

    def merged_stage(self, adapter: Any, stage: int) -> Pairs:
        """This stage's Hugging Face tensors with ``adapter`` (alone) merged in: ``W + scaling
        * B @ A`` in float32, cast back to ``W``'s dtype (as ``LoraAdapter.merged_weights``)."""
        scaling = adapter.options.scaling()
        weights = dict(self.lora_stage(adapter, stage))
        for name, w in self.base_stage(stage):
            module = name.removesuffix(".weight")
            a_name = adapter.peft_name(module, "lora_A")
            if a_name in weights:
                a, b = weights[a_name], weights[adapter.peft_name(module, "lora_B")]
                delta = (b.float() @ a.float()) * scaling
                w = (w.float() + delta).to(w.dtype)
            yield name, w

    def base(self, device: str | None) -> Pairs:
        return self.stages(self.base_stage, self.base_names, device)

    def adapter(self, adapter: Any, device: str | None) -> Pairs:
        return self.stages(
            lambda stage: self.lora_stage(adapter, stage),
            lambda stage: self.lora_names(adapter, stage),
            device,
        )

    def merged(self, adapter: Any, device: str | None) -> Pairs:
        return self.stages(lambda stage: self.merged_stage(adapter, stage), self.base_names, device)
