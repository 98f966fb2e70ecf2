"""Megatron's distributed optimizer for the policy (``backend.distributed_optimizer: true``).

The policy's part on a rank is wrapped in Megatron's ``DistributedDataParallel``: its
parameters become views of one contiguous parameter buffer, and each backward adds their
gradients to a float32 gradient buffer (``param.main_grad``). After the step's backward,
``finish_grad_sync`` reduce-scatters that buffer over the data-parallel replicas, so each
replica holds the summed gradient of its shard only; Megatron's ``DistributedOptimizer`` keeps
the Adam state of that shard alone (about ``1 / data_parallel`` of it), updates the shard and
all-gathers the parameters. The inner optimizer is ``torch.optim.AdamW`` without Apex or
Transformer Engine, their fused Adam with them.

The rest of the step is the backend's, as with the plain AdamW: the loss and its micro-batches,
the gradient fixes before the reduction (QK-norm parts over tensor-parallel ranks, a tied
embedding's two copies), clipping by the global norm with the same coefficient, the skip on a
non-finite norm, and the LR schedule (a ``LambdaLR`` on the inner optimizer). Calls into the
optimizer run in :func:`miles_backend_megatron.cpu_compat.optimizer_calls` (on a CPU, the
patches it describes).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from miles_backend_megatron import cpu_compat
from miles_backend_megatron.bridge import split_of


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide two warnings that say nothing about a run: the shards Megatron steps are views of
    the parameters (torch warns when an optimizer reads a view's ``.grad``), and torch's
    renaming of the collectives Megatron calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not")
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
            "deprecated",
        )
        yield


class DistributedAdam:
    """The policy's Megatron ``DistributedDataParallel`` wrapper and distributed optimizer on
    one rank (build it on every rank, after the weights are loaded)."""

    def __init__(self, model: nn.Module, options: Any, *, tied_head: nn.Parameter | None) -> None:
        """``model``: this rank's part of the policy (its parameters are moved into Megatron's
        buffers, values kept); ``options``: the backend's (lr, betas, eps, weight decay);
        ``tied_head``: on the last stage, the head's copy of a tied embedding, counted once in
        the gradient norm (with the embedding)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        # Megatron's gradient norm counts a parameter without ``tensor_model_parallel`` once,
        # on the first tensor-parallel rank, as a duplicate. Its layers set that attribute only
        # when they initialise their weights, which the backend does not ask of them (it loads
        # the checkpoint): the split weights are marked here (column and gate/up parts along
        # the rows, row parts along the columns), or at tensor parallel > 1 the norm would miss
        # every rank's part but the first's.
        for name, param in model.named_parameters():
            kind = split_of(name)
            if kind != "replicated" and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, True, 1 if kind == "row" else 0, 1)
        config: Any = model.config
        # The loss of the whole batch is split over the replicas' micro-batches: their
        # gradients are summed (Megatron's default divides them by the replica count).
        config.calculate_per_token_loss = True
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
        self.ddp = DistributedDataParallel(config, ddp_config, model)
        if tied_head is not None:
            # Megatron's gradient norm leaves out parameters marked shared (its own head copy of
            # a tied embedding on the last stage); the backend's copy is the same thing.
            tied_head.shared = True  # type: ignore[attr-defined]
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=options.lr,
            weight_decay=options.weight_decay,
            adam_beta1=options.betas[0],
            adam_beta2=options.betas[1],
            adam_eps=options.eps,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=True,
            clip_grad=0.0,  # the backend clips (see step)
        )
        with cpu_compat.optimizer_calls():
            # config_overrides={}: weight decay on every parameter, as AdamW (Megatron's default
            # exempts biases and norms).
            self.megatron: Any = get_megatron_optimizer(optimizer_config, [self.ddp], {})
        chained = getattr(self.megatron, "chained_optimizers", [self.megatron])
        if len(chained) != 1:
            raise RuntimeError(f"expected one Megatron optimizer (a dense model), got {chained}")
        self.chained: list[Any] = chained
        #: the torch optimizer over this rank's shards: its param groups carry the lr the
        #: schedule sets, its state is this rank's checkpoint of the optimizer
        self.inner: torch.optim.Optimizer = chained[0].optimizer

    def zero_grad(self) -> None:
        """Zero the gradient buffer and the shards' gradients before a step's backward."""
        self.ddp.zero_grad_buffer()
        with _quiet():
            self.megatron.zero_grad(set_to_none=True)

    def reduce(self) -> None:
        """Reduce-scatter the gradient buffer over the data-parallel replicas (sum)."""
        with _quiet():
            self.ddp.finish_grad_sync()

    def step(self, max_norm: float | None) -> tuple[float, bool]:
        """The global gradient norm (Megatron's: over every rank's shard, each weight once),
        clipping by it, one Adam step of the shard and the parameters' all-gather, skipped on
        a non-finite norm; returns ``(norm, skipped)``."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with cpu_compat.optimizer_calls(), _quiet():
            self.megatron.prepare_grads()
            norm = float(self.megatron.get_grad_norm())
            if not math.isfinite(norm):
                self.megatron.zero_grad(set_to_none=True)
                return norm, True
            if max_norm is not None:
                for optimizer in self.chained:
                    params = optimizer.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm, norm)
            self.megatron.step_with_ready_grads()
        return norm, False

    def named_state_params(self) -> list[tuple[str, nn.Parameter]]:
        """The inner optimizer's parameters (this rank's shards), named by their place."""
        return [
            (f"shard/{g}/{i}", p)
            for g, group in enumerate(self.inner.param_groups)
            for i, p in enumerate(group["params"])
        ]

    def offload(self) -> None:
        """On a GPU, free the parameter and gradient buffers (kept on the CPU; the views into
        them stay valid: Megatron resizes the storage)."""
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            buffer.offload_to_cpu(move_params=True, move_grads=True)

    def reload(self) -> None:
        """Undo :meth:`offload` (the gradient buffer comes back zeroed)."""
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
