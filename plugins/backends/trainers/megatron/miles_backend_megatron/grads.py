"""A Megatron rank's gradients after the backward: completed over the groups that hold parts
of them, their global norm, the clipping and the optimizer step."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from miles_trainer_common.worker import finish_step
from torch import Tensor, nn

from miles_backend_megatron import lora
from miles_backend_megatron.bridge import split_of
from miles_backend_megatron.distributed_optimizer import DistributedAdam
from miles_backend_megatron.pipeline import Layout

Named = list[tuple[str, nn.Parameter]]


def _zero_filled(p: nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def broadcast_from_first(layout: Layout, params: list[nn.Parameter]) -> None:
    """Every tensor-parallel rank computes these (whole) parameters' gradients from the same
    inputs; taking the first rank's keeps the copies bitwise equal whatever the kernels do."""
    from megatron.core import parallel_state as ps

    src = ps.get_tensor_model_parallel_src_rank()
    for p in params:
        dist.broadcast(_zero_filled(p), src=src, group=layout.tp_group)


def reduce_grads(
    layout: Layout,
    named: Named,
    *,
    tied_group: object | None = None,
    adapters: bool = False,
    sharded: DistributedAdam | None = None,
) -> None:
    """Complete each gradient before the norm: QK-norm parts summed over the tensor-parallel
    group, a tied embedding's two copies (``tied_group``: the embedding group) summed,
    replicas summed. With ``sharded`` (Megatron's distributed optimizer), the gradients are
    in its buffer (``param.main_grad``) and the replicas' sum is its reduce-scatter."""

    def grad(p: nn.Parameter) -> Tensor:
        if sharded is not None:
            return p.main_grad  # type: ignore[attr-defined,no-any-return]
        return _zero_filled(p)

    if layout.tp > 1:
        # QK-norm weights are whole on every rank but each rank normalises only its own
        # heads: each holds part of their gradient, which is summed over the group.
        for name, p in named:
            if name.endswith(("q_layernorm.weight", "k_layernorm.weight")) and (
                sharded is not None or p.grad is not None
            ):
                dist.all_reduce(grad(p), group=layout.tp_group)
    if tied_group is not None:
        # The embedding (first stage) and the head (last stage) are one tied weight kept as
        # two copies: each gets the sum of both gradients.
        for name, p in named:
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                dist.all_reduce(grad(p), group=tied_group)
    if sharded is not None:
        sharded.reduce()
        return
    if layout.tp > 1 and adapters:
        # A LoRA tensor whole on every tensor-parallel rank gets the same gradient on each (its
        # branch's collectives make it whole).
        whole = [p for name, p in named if lora.lora_split(name) == "replicated"]
        broadcast_from_first(layout, whole)
    if layout.dp > 1:
        for _, p in named:
            dist.all_reduce(_zero_filled(p), group=layout.dp_group)


def grad_norm(layout: Layout, named: Named, *, tied_copies: bool) -> float:
    """The global L2 norm of the gradients: tensor-parallel parts summed over the
    tensor-parallel group, parameters whole on every rank counted once."""
    split = torch.zeros((), dtype=torch.float64, device=layout.device)
    whole = torch.zeros((), dtype=torch.float64, device=layout.device)
    for name, p in named:
        if p.grad is None or (tied_copies and name == "output_layer.weight"):
            continue  # the head's copy of a tied embedding is counted once, with it
        sq = p.grad.detach().double().pow(2).sum()
        if split_of(name) != "replicated":
            split += sq
        else:
            whole += sq
    if layout.tp > 1:
        dist.all_reduce(split, group=layout.tp_group)
    total = split + whole
    if layout.pp > 1:
        dist.all_reduce(total, group=layout.pp_group)
    return float(total.sqrt())


def clip_and_step(
    layout: Layout,
    named: Named,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    max_norm: float | None,
    *,
    tied_copies: bool = False,
    sharded: DistributedAdam | None = None,
) -> tuple[float, float, bool]:
    """Clip by the global norm, one optimizer step and one schedule step
    (:func:`~miles_trainer_common.worker.finish_step`); returns ``(norm, lr, skipped)``.
    With ``sharded``, its norm, clipping and step (the same rule, over the shards)."""
    if sharded is not None:
        lr = float(scheduler.get_last_lr()[0])
        norm, skipped = sharded.step(max_norm)
        scheduler.step()
        return norm, lr, skipped
    norm = grad_norm(layout, named, tied_copies=tied_copies)
    if max_norm is not None and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for _, p in named:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return finish_step(optimizer, scheduler, norm)
