"""One rank of the Megatron trainer: what differs from every backend's rank
(:class:`miles_trainer_common.worker.TrainerRank`): its stage of the model and its
tensor-parallel part (:mod:`.pipeline`), the optimizer over that part (AdamW, or Megatron's
distributed optimizer), the gradients completed over the parallel groups (:mod:`.grads`), and
the weights gathered stage by stage (:mod:`.export`).

The same class runs in-process (one rank: a real one-rank gloo/NCCL group) and in each spawned
worker process (``tensor x pipeline x data`` ranks). The ranks of one data-parallel replica (its
tensor-parallel group) run the same micro-batches; replicas split the batch's micro-batches
between them and run the same number of forward passes, because every forward holds
tensor-parallel collectives.

With adapters (``lora``), the base is frozen and LoRA branches sharded like the base weights
sit on the policy's linears, one set per adapter (:mod:`miles_backend_megatron.lora`): only
they are optimised (each adapter by its own AdamW and LR schedule, on the groups that name it),
checkpointed and exported.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from miles_trainer_common.batch import PackedBatch
from miles_trainer_common.worker import Pairs, Round, TrainerRank
from torch import Tensor, nn

from miles_backend_megatron import checkpoint, cpu_compat, grads, lora, pipeline
from miles_backend_megatron.bridge import stage_layers
from miles_backend_megatron.distributed_optimizer import DistributedAdam
from miles_backend_megatron.export import StageExport
from miles_backend_megatron.lora import lora_layer_spec
from miles_backend_megatron.model import (
    Critic,
    build_model,
    drop_vocab_head,
    init_std,
    load_weights,
    value_head,
)
from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_backend_megatron.shape import ModelShape

#: Megatron's own warnings that say nothing about a run of this backend: optional CUDA
#: libraries it falls back from (Transformer Engine, Apex), and deprecations of arguments it
#: passes itself.
_MEGATRON_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"Warning: tp_group is None",
    r"MLP requires ffn_hidden_size",
)


def quiet_megatron() -> None:
    """Hide :data:`_MEGATRON_NOISE` (only those messages, only from megatron's modules)."""
    for message in _MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, module=r"megatron(\.|$)")


# What every rank's build imports (5 s of CPU here), imported with this module rather than at
# the build: ranks on the CPU are forks of a server that imported this module
# (``miles_trainer_common.processes``), and then start without importing it again.
with warnings.catch_warnings():
    quiet_megatron()
    import megatron.core.distributed
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.models.gpt.gpt_model
    import megatron.core.optimizer
    import megatron.core.optimizer.clip_grads  # noqa: F401


class RankWorker(TrainerRank):
    """One Megatron rank (see the module docstring)."""

    backend = "megatron"
    supported_needs = SUPPORTED_NEEDS

    options: MegatronOptions

    def _join(self, store_path: str | None) -> None:
        quiet_megatron()
        options, rank, world_size = self.options, self.rank, self.world_size
        if options.distributed_optimizer and self.adapters:
            raise ValueError(
                "backend.distributed_optimizer: Megatron's distributed optimizer trains the "
                "whole policy; with an adapter (LoRA) use distributed_optimizer: false"
            )
        if world_size != options.world_size:
            raise ValueError(f"world_size {world_size} != options.world_size {options.world_size}")
        if options.device != "cuda" and not cpu_compat.needed():
            # Megatron places its own buffers on torch.cuda.current_device() whenever CUDA is
            # there (the attention's score buffer among them), and the CPU patches that
            # redirect it apply only on a machine without CUDA.
            raise RuntimeError(
                "backend.device: 'cpu' runs Megatron only on a machine without CUDA; torch "
                "sees a CUDA device here: use device 'cuda'"
            )
        self.device = self._place()
        if self.device.type == "cpu":
            cpu_compat.apply()
        self.layout = pipeline.Layout.join(options, store_path, rank, self.device)
        self.replicas, self.replica = self.layout.dp, self.layout.dp_rank
        #: each adapter's adapted projections (``lora.Target``) of the whole model, in its
        #: order, by the adapter's name
        self.lora_targets: dict[str, list[Any]] = {}
        #: Megatron's distributed optimizer of the policy (``distributed_optimizer``): its
        #: buffers hold the policy's parameters and gradients, its inner optimizer is
        #: ``self.optimizers[""]``
        self.sharded: DistributedAdam | None = None
        self.shape: ModelShape | None = None
        self.tied_copies = False
        self.embedding_group: Any = None
        #: the weights gathered stage by stage (built by setup)
        self.exporter: StageExport
        #: the layer spec the model is built with (``local`` with an adapter, and in true
        #: on-policy mode: the modules of :mod:`miles_backend_megatron.invariant`, one
        #: tensor-parallel rank, each sample forwarded in its own row)
        self.layer_spec: str = "local" if self.true_on_policy else options.layer_spec
        #: a group's prompt forwarded once (not in true on-policy mode: each sample's keys
        #: must sit where the engine's cache holds them)
        self.shares_prompts = options.share_prompts and not self.true_on_policy

    # --- setup ------------------------------------------------------------------------

    def _load(
        self, trainable: bool, *, critic: str | None = None, shape: ModelShape | None = None
    ) -> nn.Module:
        """This rank's part of the policy's checkpoint, or of a critic's body (``critic``: its
        checkpoint, with ``shape``), built and split the same way."""
        shape = shape or self.shape
        assert shape is not None
        lay = self.layout
        model = build_model(
            shape,
            lay.tp,
            lay.pp,
            lay.pp_rank,
            self.device,
            self.layer_spec,
            invariant=self.true_on_policy and critic is None,
        )
        if critic is not None:
            drop_vocab_head(model)  # values, not logits
        path = critic or self.model_path
        value = critic is not None
        load_weights(model, path, shape, lay.tp_rank, lay.tp, lay.pp_rank, lay.pp, value=value)
        if not trainable:
            for p in model.parameters():
                p.requires_grad_(False)
        return model

    def setup(self, model_path: str) -> None:
        """Check the split against the model, build and load this rank's part (and each
        adapter's branches on it), build AdamW and the LR schedule (one of each per
        adapter)."""
        from megatron.core import parallel_state as ps

        o = self.options
        shape = self.shape = ModelShape.from_path(model_path)
        shape.check_parallel(o.tensor_parallel, o.pipeline_parallel)
        self.tied_copies = shape.tied and o.pipeline_parallel > 1
        if self.tied_copies:
            self.embedding_group = ps.get_embedding_group()
        self._seed()
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            # Megatron forks named CUDA RNG streams around dropout in tensor-parallel regions
            # (attention's among them, even at p=0): on a GPU they must be seeded (on the CPU,
            # cpu_compat's null tracker stands in).
            tensor_parallel.model_parallel_cuda_manual_seed(o.seed)
        self.model_path = model_path
        if self.adapters:
            self.layer_spec = lora_layer_spec(o.layer_spec, self.device)
        model = self.model = self._load(trainable=not self.adapters)
        units: dict[str, tuple[list[tuple[str, nn.Parameter]], float | None]] = {}
        if not self.adapters:
            units[""] = (list(model.named_parameters()), None)
        layers = stage_layers(shape, self.layout.pp_rank, o.pipeline_parallel)
        for adapter in self.adapters:
            targets = self.lora_targets[adapter.name] = lora.plan(adapter, model_path)
            named = lora.attach(
                model, adapter, targets, shape, self.layout.tp_rank, o.tensor_parallel, layers,
                self.device,
            )  # fmt: skip
            units[adapter.name] = (named, adapter.lr)
        if self.adapters:
            lora.activate(model, self.adapters[0].name)
        self.sharded = None
        if o.distributed_optimizer:
            tied = self.tied_copies and self.layout.last_stage
            tied_head = model.get_parameter("output_layer.weight") if tied else None
            self.sharded = DistributedAdam(model, o, tied_head=tied_head)
        self._build_optimizers(units)
        self.exporter = StageExport(self.layout, shape, model, self.lora_targets, o.export_dtype)

    def _optimizer(self, params: list[nn.Parameter], lr: float | None) -> torch.optim.Optimizer:
        if self.sharded is not None:
            return self.sharded.inner  # over this rank's shards of the policy
        return super()._optimizer(params, lr)

    def _switch_adapter(self, adapter: Any) -> None:
        assert self.model is not None
        lora.activate(self.model, adapter.name)

    def _adapters_off(self, model: nn.Module) -> AbstractContextManager[Any]:
        return lora.disabled(model)

    def _build_reference(self) -> nn.Module:
        return self._load(trainable=False)

    def _make_critic(self) -> Critic:
        """The critic on ``critic.path`` (default: the policy's checkpoint), split like the
        policy, its value head on the last stage (:func:`model.value_head`: from the seed
        alone, so the critic is the same whenever built, the run's RNG stream untouched)."""
        o = self.options
        path = o.critic.path or self.model_path
        shape = ModelShape.from_path(path, value=True)
        shape.check_parallel(o.tensor_parallel, o.pipeline_parallel)
        with torch.random.fork_rng(devices=[]):
            body = self._load(trainable=True, critic=path, shape=shape)
        head_ = None
        if self.layout.last_stage:
            head_ = value_head(path, shape.hidden, o.seed, self.device, init_std(path))
        return Critic(body, head_)

    # --- forward and backward -----------------------------------------------------------

    def _policy_round(
        self, model: nn.Module, packed: PackedBatch, rows: list[int], *, entropy: bool
    ) -> Round:
        return self._round(model, packed, rows, entropy, None)

    def _value_round(self, critic: nn.Module, packed: PackedBatch, rows: list[int]) -> Round:
        assert isinstance(critic, Critic)
        return self._round(critic.body, packed, rows, False, critic.value_head)

    def _round(
        self, model: nn.Module, packed: PackedBatch, rows: list[int], entropy: bool, head: Any
    ) -> Round:
        shared, invariant = self.shares_prompts, self.true_on_policy
        return pipeline.forward_round(
            self.layout, model, packed, rows, entropy=entropy, shared=shared,
            invariant=invariant, value_head=head,
        )  # fmt: skip

    def _backward_round(self, round_: Round, g_out: Tensor, g_ent: Tensor | None) -> None:
        pipeline.backward_round(self.layout, round_, g_out, g_ent)

    def _gather(self, lp: Tensor, ent: Tensor, entropy: bool) -> None:
        pipeline.gather(self.layout, lp, ent, entropy)

    def _zero_grad(self, key: str) -> None:
        if self.sharded is not None:
            self.sharded.zero_grad()  # its buffer, and its inner optimizer's shards
        else:
            super()._zero_grad(key)

    def _step(self, key: str) -> tuple[float, float, bool]:
        named = self.trained[key]
        grads.reduce_grads(
            self.layout,
            named,
            tied_group=self.embedding_group if self.tied_copies else None,
            adapters=bool(self.adapters),
            sharded=self.sharded,
        )
        return grads.clip_and_step(
            self.layout,
            named,
            self.optimizers[key],
            self.schedulers[key],
            self.options.max_grad_norm,
            tied_copies=self.tied_copies,
            sharded=self.sharded,
        )

    def _step_critic(self, critic: nn.Module) -> tuple[float, float, bool]:
        assert isinstance(critic, Critic)
        assert self.critic_optimizer is not None and self.critic_scheduler is not None
        named = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
        grads.reduce_grads(self.layout, named, adapters=bool(self.adapters))
        if self.layout.tp > 1 and critic.value_head is not None:
            # Every tensor-parallel rank computes the head's gradient from the same hidden
            # states and the same value gradient.
            grads.broadcast_from_first(self.layout, list(critic.value_head.parameters()))
        return grads.clip_and_step(
            self.layout,
            named,
            self.critic_optimizer,
            self.critic_scheduler,
            self.options.critic.max_grad_norm,
            tied_copies=self.tied_copies,
        )

    # --- weights --------------------------------------------------------------------------

    def _base_tensors(self, device: str | None) -> Pairs:
        return self.exporter.base(device)

    def _adapter_tensors(self, adapter: Any, device: str | None) -> Pairs:
        return self.exporter.adapter(adapter, device)

    def _merged_tensors(self, adapter: Any, device: str | None) -> Pairs:
        return self.exporter.merged(adapter, device)

    def _weight_pairs(self) -> Pairs:
        return self.exporter.base(None)

    def _adapter_pairs(self, adapter: Any) -> Pairs:
        return self.export_tensors(adapter=adapter.name)

    def _optim_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        if self.sharded is not None:
            return self.sharded.named_state_params()  # its state is keyed by the shards
        return list(model.named_parameters())

    def optimizer_state_elements(self) -> int:
        """Elements of the policy's optimizer state (Adam's moments) on this rank."""
        return sum(
            v.numel()
            for optimizer in self.optimizers.values()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor) and v.dim() > 0
        )

    # --- checkpoints ----------------------------------------------------------------------

    def _save_state(self, path: str) -> dict[str, Any]:
        return checkpoint.save(self, path)

    def _check_saved(self, path: str, meta: dict[str, Any]) -> None:
        checkpoint.check(self, path, meta)

    def _load_state(self, path: str, meta: dict[str, Any]) -> None:
        checkpoint.load(self, path, meta)

    # --- placement ------------------------------------------------------------------------

    def _sleep_models(self) -> list[nn.Module | None]:
        models = super()._sleep_models()
        if self.sharded is not None and self.device.type == "cuda":
            # The policy's parameters are views of Megatron's buffers: moving the module would
            # cut them off; the buffers are offloaded in place instead.
            models[0] = None
            self.sharded.offload()
        from megatron.core import parallel_state as ps

        buffers = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
        if self.device.type == "cuda" and buffers is not None:
            # The local spec's attention keeps its largest score buffer ([b * heads, s, s],
            # on the GPU) for reuse: the engine wants that memory while the trainer sleeps.
            buffers.buffer.clear()
        return models

    def _wake_models(self) -> list[nn.Module | None]:
        models = super()._wake_models()
        if self.sharded is not None and self.device.type == "cuda":
            models[0] = None
            self.sharded.reload()
        return models
