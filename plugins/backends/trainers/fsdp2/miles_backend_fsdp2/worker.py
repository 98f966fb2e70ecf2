"""One rank of the FSDP2 trainer: what differs from every backend's rank
(:class:`miles_trainer_common.worker.TrainerRank`): the model loaded and sharded by FSDP2, its
forward, the gradient's reduce-scatter and clipping, and the weights gathered from the shards.

The same class runs in-process (world size 1, a real one-rank gloo/NCCL group) and in each
spawned worker process (world size N). FSDP2 all-gathers parameters in every forward, so every
rank runs the same number of forward passes (a rank with fewer micro-batches runs padding
passes whose results are discarded).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# What every model build imports (4 s of CPU here), imported with the rank's module rather than
# at the build: ranks on the CPU are forks of a server that imported this module
# (``miles_trainer_common.processes``), and then start without importing it again.
import transformers.modeling_utils  # noqa: F401
from miles_trainer_common.batch import PackedBatch
from miles_trainer_common.worker import Pairs, Round, TrainerRank, finish_step, join_group
from torch import Tensor, nn

from miles_backend_fsdp2 import checkpoint
from miles_backend_fsdp2.model import (
    load_sharded,
    token_logprobs,
    token_logprobs_shared,
    token_values,
    token_values_shared,
)
from miles_backend_fsdp2.options import SUPPORTED_NEEDS, FSDP2Options
from miles_core.contracts import each_tensor_once
from miles_core.invariant.kernels import TILE, invariant_mode, prepare


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full(t: Tensor) -> Tensor:
    """The whole tensor of a sharded (DTensor) one, gathered from every rank (collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_on_first(t: Tensor, out: Tensor | None = None) -> Tensor:
    """The whole tensor of a sharded (DTensor) one on the first rank of its mesh, an empty
    tensor on the others (collective over the mesh): what a weight export needs, where the
    first rank alone sends. Sharded on one dimension of a 1-D mesh (FSDP2's layout), each
    other rank sends its shard point to point, straight into its place in the whole tensor
    (``out`` when it has the whole tensor's shape, dtype and device, else a new one):
    gloo's all-gather of the same bytes took 8 times as long, and filled every rank. Any
    other layout is gathered by ``full_tensor()`` (every rank gets the whole tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t
    mesh, placements = t.device_mesh, t.placements
    one_dim = mesh.ndim == 1 and len(placements) == 1 and isinstance(placements[0], Shard)
    if not one_dim or int(mesh.mesh.flatten()[0]) != 0:  # the export's rank 0 heads the mesh
        return t.full_tensor()
    dim, world = placements[0].dim, mesh.size()
    group, me, local = mesh.get_group(), mesh.get_local_rank(), t.to_local()
    # DTensor's Shard splits as torch.chunk does (the last ranks may hold nothing)
    sizes = _chunks(t.shape[dim], world)
    if local.shape[dim] != sizes[me]:
        raise RuntimeError(
            f"shard of {local.shape[dim]} rows on rank {me}, expected {sizes[me]} of "
            f"{t.shape[dim]} split {world} ways"
        )
    if me != 0:
        if sizes[me]:
            dist.send(local.contiguous(), group=group, group_dst=0)
        return local.new_empty(0)
    whole = out if _fits(out, local, t.shape) else local.new_empty(t.shape)
    start = 0
    for rank, size in enumerate(sizes):
        part = whole.narrow(dim, start, size)
        start += size
        if rank == 0:
            part.copy_(local)
        elif size and part.is_contiguous():
            dist.recv(part, group=group, group_src=rank)
        elif size:
            piece = local.new_empty(part.shape)
            dist.recv(piece, group=group, group_src=rank)
            part.copy_(piece)
    return whole


def _fits(out: Tensor | None, like: Tensor, shape: Any) -> bool:
    """Whether ``out`` can hold a tensor of ``shape`` with ``like``'s dtype and device."""
    return (
        out is not None
        and out.shape == shape
        and out.dtype == like.dtype
        and out.device == like.device
        and out.is_contiguous()
    )


def _chunks(n: int, world: int) -> list[int]:
    """The sizes of ``torch.chunk(range(n), world)``, padded with zeros to ``world``."""
    step = -(-n // world) if n else 0
    sizes = [min(step, n - i) for i in range(0, n, step)] if n else []
    return sizes + [0] * (world - len(sizes))


def _update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    max_norm: float | None,
) -> tuple[float, float, bool]:
    """Clip the global gradient norm of the optimizer's parameters, then step it and the LR
    schedule (:func:`~miles_trainer_common.worker.finish_step`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    return finish_step(optimizer, scheduler, float(full(norm)))


class RankWorker(TrainerRank):
    """One FSDP2 rank (see the module docstring)."""

    backend = "fsdp2"
    supported_needs = SUPPORTED_NEEDS

    options: FSDP2Options

    def _join(self, store_path: str | None) -> None:
        #: with ``share_prompts`` in true on-policy mode, a group shares only its prompt's whole
        #: key tiles, so that every key lies where the engine's cache holds it
        #: (see ``token_logprobs_shared``)
        self._tile = TILE if self.true_on_policy else None
        self.device = self._place()
        join_group(self.device, store_path, self.rank, self.world_size, self.options.timeout_s)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Every adapter's parameters (kept trainable: see _keep_trainable)
        self._adapter_params: list[nn.Parameter] = []
        #: rank 0's whole tensor of each exported name, on the CPU, gathered into again at the
        #: next export while ``export_into_kept`` (see _stream)
        self._exported: dict[str, Tensor] = {}

    # --- setup ------------------------------------------------------------------------

    def _load(
        self,
        trainable: bool,
        *,
        value: bool = False,
        path: str | None = None,
        adapters: list[Any] | None = None,
    ) -> nn.Module:
        model = load_sharded(
            path or self.model_path,
            self.options,
            self.mesh,
            self.device,
            trainable=trainable,
            value=value,
            adapters=adapters or (),
        )
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Each rank backpropagates the gradient of the whole batch's loss through its
                # own samples, so the ranks' gradients are summed, not averaged.
                module.set_gradient_divide_factor(1.0)
                # Gloo has no pre-multiplied sum: reduce with a plain sum (the factor is 1).
                module.set_force_sum_reduction_for_comms(True)
        if self.true_on_policy:
            prepare(model)
        return model

    def setup(self, model_path: str) -> None:
        """Load, shard, and build AdamW and the LR schedule (one of each per adapter)."""
        self._seed()
        self.model_path = model_path
        # With adapters only the policy is wrapped: the critic (PPO) stays a full model,
        # fully fine-tuned, and the reference is the policy with its adapters disabled.
        model = self.model = self._load(trainable=True, adapters=self.adapters)
        self._watch_routing(model)
        units: dict[str, tuple[list[tuple[str, nn.Parameter]], float | None]] = {}
        if not self.adapters:
            units[""] = (list(model.named_parameters()), None)
        self._adapter_params = []
        for adapter in self.adapters:
            named = list(adapter.parameters(model))
            if not named:
                raise RuntimeError(f"adapter {adapter.name!r} has no parameter in the model")
            units[adapter.name] = (named, adapter.lr)
            self._adapter_params += [p for _, p in named]
        self._keep_trainable()
        self._build_optimizers(units)

    def _keep_trainable(self) -> None:
        """Every adapter's parameters trainable again: peft's ``set_adapter`` and
        ``disable_adapter`` freeze the inactive adapters, and a frozen one would be left out
        of the checkpoint (``ignore_frozen_params``). An inactive adapter takes no part in
        the forward, so it gets no gradient (and FSDP2 reduces none) all the same."""
        for p in self._adapter_params:
            p.requires_grad_(True)

    def _switch_adapter(self, adapter: Any) -> None:
        assert self.model is not None
        adapter.activate(self.model)
        self._keep_trainable()

    @contextmanager
    def _adapters_off(self, model: nn.Module) -> Iterator[None]:
        try:
            with model.disable_adapter():  # type: ignore[operator]
                yield
        finally:
            self._keep_trainable()

    def _build_reference(self) -> nn.Module:
        return self._load(trainable=False)

    def _make_critic(self) -> nn.Module:
        """The critic on ``critic.path`` (default: the policy's checkpoint). Its new value
        head is drawn from a generator seeded with ``seed`` alone, so the critic is the same
        whenever it is built and the run's RNG stream is untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.options.seed)
            return self._load(trainable=True, value=True, path=self.options.critic.path)

    # --- forward and backward -----------------------------------------------------------

    def _policy_round(
        self, model: nn.Module, packed: PackedBatch, rows: list[int], *, entropy: bool
    ) -> Round:
        routing = self._routers.get(id(model))
        with invariant_mode(self.true_on_policy):
            if self.options.share_prompts:
                lp, ent = token_logprobs_shared(
                    model, packed, rows, entropy=entropy, routing=routing, tile=self._tile
                )
            else:
                lp, ent = token_logprobs(model, packed, rows, entropy=entropy, routing=routing)
        return Round(lp, ent, lp.shape[1])

    def _value_round(self, critic: nn.Module, packed: PackedBatch, rows: list[int]) -> Round:
        if self.options.share_prompts:
            values = token_values_shared(critic, packed, rows)
        else:
            values = token_values(critic, packed, rows)
        return Round(values, None, values.shape[1])

    def _gather(self, lp: Tensor, ent: Tensor, entropy: bool) -> None:
        if self.world_size > 1:
            dist.all_reduce(lp)
            if entropy:
                dist.all_reduce(ent)

    def _grad_sync(self, module: nn.Module, last: bool) -> None:
        # Reduce-scatter once, after the last micro-batch; earlier ones accumulate locally.
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(last)

    def _step(self, key: str) -> tuple[float, float, bool]:
        return _update(self.optimizers[key], self.schedulers[key], self.options.max_grad_norm)

    def _step_critic(self, critic: nn.Module) -> tuple[float, float, bool]:
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        return _update(
            self.critic_optimizer, self.critic_scheduler, self.options.critic.max_grad_norm
        )

    # --- weights --------------------------------------------------------------------------

    def _stream(self, pairs: Iterator[tuple[str, Tensor]], device: str | None) -> Pairs:
        """(name, full tensor) of each (name, state-dict value or full tensor), in the
        options' ``export_dtype`` and on ``device``; whole on rank 0 alone, empty on the others
        (the collective export takes rank 0's: :func:`gathered_on_first`)."""
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.options.export_dtype or "")
        for name, value in pairs:
            kept = self._exported.get(name) if self.export_into_kept else None
            whole = gathered_on_first(value, kept).detach()
            if whole.data_ptr() == _local(value).data_ptr():
                # One rank: the "gathered" tensor may be the parameter itself, which changes
                # at the next step: what is yielded is a copy.
                whole = kept.copy_(whole) if _fits(kept, whole, whole.shape) else whole.clone()
            if self.export_into_kept and whole.device.type == "cpu" and whole.numel():
                # Kept for the next export, which gathers into it: fresh memory costs a page
                # fault per page at its first write, more than the gather itself on the CPU
                # (155 MB: 0.12 s fresh, 0.02 s reused). A device's allocator reuses its own.
                self._exported[name] = whole
            if dtype is not None and whole.is_floating_point():
                whole = whole.to(dtype)
            if device is not None:
                whole = whole.to(device)
            yield name, whole

    def _base_tensors(self, device: str | None) -> Pairs:
        assert self.model is not None
        state = self.model.state_dict(keep_vars=True)
        return self._stream(((n, t.detach()) for n, t in each_tensor_once(state)), device)

    def _adapter_tensors(self, adapter: Any, device: str | None) -> Pairs:
        return self._stream(adapter.named_weights(self.model), device)

    def _merged_tensors(self, adapter: Any, device: str | None) -> Pairs:
        return self._stream(adapter.merged_weights(self.model, full), device)

    def _weight_pairs(self) -> Pairs:
        assert self.model is not None
        return ((name, full(value)) for name, value in self.model.state_dict().items())

    def _adapter_pairs(self, adapter: Any) -> Pairs:
        return iter(adapter.named_weights(self.model, full))

    def _state_tensor(self, t: Tensor) -> Tensor:
        return full(t)

    def _combine(self, h: Any) -> str:
        return str(h.hexdigest())  # every rank hashed the gathered tensors

    # --- checkpoints ----------------------------------------------------------------------

    def _save_state(self, path: str) -> dict[str, Any]:
        return checkpoint.save(self, path)

    def _saved_adapters(self, meta: dict[str, Any]) -> dict[str, Any]:
        if "adapters" in meta:
            return dict(meta["adapters"])
        old = meta.get("adapter")  # written before a trainer held several adapters
        return {} if old is None else {"default": old}

    def _load_state(self, path: str, meta: dict[str, Any]) -> None:
        checkpoint.load(self, path, meta)
