"""One rank of the Megatron trainer: its stage of the model, its tensor-parallel part, the
optimizer over that part, and every operation.

The same class runs in-process (one rank: a real one-rank gloo/NCCL group) and in each spawned
worker process (``tensor x pipeline x data`` ranks). Every method is collective: all ranks
call it with the same arguments. The ranks of one data-parallel replica (its tensor-parallel
group) run the same micro-batches; replicas split the batch's micro-batches between them and
run the same number of forward passes (a replica with fewer runs padding passes whose results
are discarded), because every forward holds tensor-parallel collectives.

With adapters (``lora``), the base is frozen and LoRA branches sharded like the base weights
sit on the policy's linears, one set per adapter (:mod:`miles_backend_megatron.lora`): only
they are optimised (each adapter by its own AdamW and LR schedule, on the groups that name
it), checkpointed and exported.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from miles_trainer_common import rank as shared
from miles_trainer_common.batch import (
    PackedBatch,
    assign_to_ranks,
    pack,
    plan_by_length,
    plan_groups,
)
from miles_trainer_common.batch import token_batch as make_token_batch
from miles_trainer_common.controller import by_adapter, pick_adapter, train_by_adapter
from miles_trainer_common.layout import shared_layout
from miles_trainer_common.logprobs import check_on_policy, logprobs_at
from miles_trainer_common.rank import adamw, check_algorithm, empty_adamw, seed_everything
from miles_trainer_common.schedule import LRSchedule
from miles_trainer_common.state import (
    hash_tensor,
    load_checkpoint_file,
    rng_state,
    set_rng_state,
)
from torch import Tensor, nn

from miles_backend_megatron import cpu_compat, lora
from miles_backend_megatron.bridge import (
    hf_stage,
    split_of,
    stage_hf_names,
    stage_layers,
    unshard,
)
from miles_backend_megatron.distributed_optimizer import DistributedAdam
from miles_backend_megatron.lora import lora_layer_spec
from miles_backend_megatron.model import (
    Critic,
    build_model,
    causal_mask,
    drop_vocab_head,
    head,
    hidden_size,
    hidden_states,
    init_std,
    load_weights,
    spec_name,
    value_head,
    values_at,
)
from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_backend_megatron.shape import ModelShape, hf_shapes
from miles_core.contracts import AlgorithmImpl

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


def _init_parallel(options: MegatronOptions, store_path: str | None, rank: int) -> None:
    """The default process group and Megatron's tensor/pipeline/data-parallel groups."""
    from megatron.core import parallel_state as ps

    world = options.world_size
    backend = "cpu:gloo,cuda:nccl" if options.device == "cuda" else "gloo"
    timeout = timedelta(seconds=options.timeout_s)
    if not dist.is_initialized():
        store: Any = (
            dist.HashStore()  # type: ignore[attr-defined]
            if store_path is None
            else dist.FileStore(store_path, world)  # type: ignore[attr-defined]
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    elif dist.get_world_size() != world:
        raise RuntimeError(
            f"this process already has a default process group of {dist.get_world_size()} "
            f"ranks; the megatron trainer needs {world}"
        )
    tp, pp = options.tensor_parallel, options.pipeline_parallel
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_pipeline_model_parallel_world_size() == pp
        ):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=max(1, int(options.timeout_s // 60)),
    )


class RankWorker:
    """The state and operations of one rank (see the module docstring)."""

    def __init__(
        self,
        options: MegatronOptions,
        rank: int,
        world_size: int,
        store_path: str | None = None,
        adapter: Any = None,
        adapters: Any = None,
        true_on_policy: bool = False,
    ) -> None:
        quiet_megatron()
        from megatron.core import parallel_state as ps

        self.options = options
        #: the run's adapters (``miles_lora.LoraAdapter``, distinct names): LoRA branches on
        #: the policy's linears, one set each; only they train (each with its own optimizer,
        #: on the groups that name it) and are exported; empty: full fine-tuning.
        #: ``adapter=x`` is ``adapters=[x]``.
        self.adapters: list[Any] = (
            list(adapters) if adapters is not None else [adapter] if adapter is not None else []
        )
        #: each adapter's adapted projections (``lora.Target``) of the whole model, in its
        #: order, by the adapter's name
        self.lora_targets: dict[str, list[Any]] = {}
        if options.distributed_optimizer and self.adapters:
            raise ValueError(
                "backend.distributed_optimizer: Megatron's distributed optimizer trains the "
                "whole policy; with an adapter (LoRA) use distributed_optimizer: false"
            )
        #: Megatron's distributed optimizer of the policy (``distributed_optimizer``): its
        #: buffers hold the policy's parameters and gradients, its inner optimizer is
        #: ``self.optimizers[""]``
        self.sharded: DistributedAdam | None = None
        self.rank = rank
        if world_size != options.world_size:
            raise ValueError(f"world_size {world_size} != options.world_size {options.world_size}")
        if options.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device 'cuda' was asked but torch sees no CUDA device")
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            if not cpu_compat.needed():
                # Megatron places its own buffers on torch.cuda.current_device() whenever CUDA
                # is there (the attention's score buffer among them), and the CPU patches that
                # redirect it apply only on a machine without CUDA.
                raise RuntimeError(
                    "backend.device: 'cpu' runs Megatron only on a machine without CUDA; torch "
                    "sees a CUDA device here: use device 'cuda'"
                )
            self.device = torch.device("cpu")
            threads = options.cpu_threads or max(1, (os.cpu_count() or 1) // world_size)
            torch.set_num_threads(threads)
            cpu_compat.apply()
        _init_parallel(options, store_path, rank)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage = self.pp_rank == 0
        self.last_stage = self.pp_rank == options.pipeline_parallel - 1
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.tied_copies = False
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        # Megatron's rank order (tensor fastest, then data, then pipeline): the export relies
        # on it to find each stage's first rank.
        expected = self.tp_rank + options.tensor_parallel * (self.dp_rank + self.dp * self.pp_rank)
        if expected != rank:
            raise RuntimeError(f"unexpected Megatron rank order: rank {rank} is {expected}")
        self.model: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        self.shape: ModelShape | None = None
        # One AdamW and LR schedule per adapter, by its name (full fine-tuning: one, by ""),
        # on every rank: an empty one where a stage holds nothing of the adapter.
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        #: each adapter's (name, parameter) pairs on this rank, by its name ("": the whole
        #: model's trainable ones)
        self.trained: dict[str, list[tuple[str, nn.Parameter]]] = {}
        # PPO's critic (value model), its own AdamW and schedule: built the first time an
        # algorithm needs values (or a checkpoint holds them).
        self.critic: Critic | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.model_path = ""
        self.step = 0
        self.asleep = False
        #: the layer spec the model is built with (``local`` with an adapter)
        self.layer_spec: str = options.layer_spec
        #: the run's ``rollout.true_on_policy``: the policy is built with the modules of
        #: :mod:`miles_backend_megatron.invariant` (the local spec, one tensor-parallel rank),
        #: each sample forwarded in its own row, and a step whose recomputed log-probs are not
        #: bitwise the engine's fails
        self.true_on_policy = true_on_policy
        if true_on_policy:
            self.layer_spec = "local"
        #: a group's prompt forwarded once (not in true on-policy mode: each sample's keys
        #: must sit where the engine's cache holds them)
        self.shared = options.share_prompts and not true_on_policy

    # --- setup ------------------------------------------------------------------------

    def _load(
        self, trainable: bool, *, critic: str | None = None, shape: ModelShape | None = None
    ) -> nn.Module:
        """This rank's part of the policy's checkpoint, or of a critic's body (``critic``: its
        checkpoint, with ``shape``), built and split the same way."""
        shape = shape or self.shape
        assert shape is not None
        o = self.options
        model = build_model(
            shape,
            o.tensor_parallel,
            o.pipeline_parallel,
            self.pp_rank,
            self.device,
            self.layer_spec,
            invariant=self.true_on_policy and critic is None,
        )
        if critic is not None:
            drop_vocab_head(model)  # values, not logits
        load_weights(
            model,
            critic or self.model_path,
            shape,
            self.tp_rank,
            o.tensor_parallel,
            self.pp_rank,
            o.pipeline_parallel,
            value=critic is not None,
        )
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
        self.shape = ModelShape.from_path(model_path)
        self.shape.check_parallel(o.tensor_parallel, o.pipeline_parallel)
        self.tied_copies = self.shape.tied and o.pipeline_parallel > 1
        if self.tied_copies:
            self.embedding_group = ps.get_embedding_group()
        seed_everything(o.seed)
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
        layers = stage_layers(self.shape, self.pp_rank, o.pipeline_parallel)
        for adapter in self.adapters:
            targets = self.lora_targets[adapter.name] = lora.plan(adapter, model_path)
            named = lora.attach(
                model,
                adapter,
                targets,
                self.shape,
                self.tp_rank,
                o.tensor_parallel,
                layers,
                self.device,
            )
            units[adapter.name] = (named, adapter.lr)
        if self.adapters:
            lora.activate(model, self.adapters[0].name)
        self.optimizers, self.schedulers, self.trained = {}, {}, {}
        self.sharded = None
        if o.distributed_optimizer:
            tied = self.tied_copies and self.last_stage
            tied_head = model.get_parameter("output_layer.weight") if tied else None
            self.sharded = DistributedAdam(model, o, tied_head=tied_head)
        for key, (named, lr) in units.items():
            # A stage whose layers an adapter's targets leave alone has nothing of it to
            # train: an empty optimizer keeps its schedule in step with the other ranks'.
            params = [p for _, p in named]
            if self.sharded is not None:
                optimizer = self.sharded.inner  # over this rank's shards of the policy
            elif params:
                optimizer = adamw(params, o, lr=lr)
            else:
                optimizer = empty_adamw(o, lr=lr)
            schedule = LRSchedule(o.warmup_steps, o.lr_schedule, o.decay_steps, o.min_lr_ratio)
            self.optimizers[key] = optimizer
            self.schedulers[key] = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            self.trained[key] = [(n, p) for n, p in named if p.requires_grad]
        self.step = 0

    def _activate(self, name: str) -> None:
        """Adapter ``name``'s branches apply in the policy's forward (with several adapters)."""
        if len(self.adapters) > 1:
            assert self.model is not None
            lora.activate(self.model, pick_adapter(self.adapters, name, "megatron").name)

    def _build_critic(self) -> Critic:
        """The critic on ``critic.path`` (default: the policy's checkpoint), built and split
        like the policy, its value head on the last stage (:func:`model.value_head`: from the
        seed alone, so the critic is the same whenever it is built and the run's RNG stream
        is untouched), its AdamW (``critic.lr``, the policy's betas, eps, weight decay) and
        LR schedule (``critic.warmup_steps``, the policy's shape)."""
        o = self.options
        path = o.critic.path or self.model_path
        shape = ModelShape.from_path(path, value=True)
        shape.check_parallel(o.tensor_parallel, o.pipeline_parallel)
        with torch.random.fork_rng(devices=[]):
            body = self._load(trainable=True, critic=path, shape=shape)
        head_ = (
            value_head(path, shape.hidden, o.seed, self.device, init_std(path))
            if self.last_stage
            else None
        )
        critic = Critic(body, head_)
        self.critic = critic
        self.critic_optimizer = torch.optim.AdamW(
            [p for p in critic.parameters() if p.requires_grad],
            lr=o.critic.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        schedule = LRSchedule(o.critic.warmup_steps, o.lr_schedule, o.decay_steps, o.min_lr_ratio)
        self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer, schedule)
        return critic

    def _critic_ready(self) -> Critic:
        self._ready()
        return self.critic if self.critic is not None else self._build_critic()

    def _ready(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the megatron trainer is not set up: call setup(model_path) first")
        if self.asleep:
            raise RuntimeError("the megatron trainer is asleep: call wake() first")
        return self.model

    # --- forward ------------------------------------------------------------------------

    def _plan(self, packed: PackedBatch) -> tuple[list[list[int]], int, int]:
        lens = packed.seq_lens.tolist()
        budget = self.options.micro_batch_tokens
        if self.shared:
            plan = plan_groups(packed, budget)
        else:
            plan = plan_by_length(lens, budget)
        per_replica = assign_to_ranks(plan, lens, self.dp)
        return per_replica[self.dp_rank], max(len(m) for m in per_replica), len(plan)

    # A round is one micro-batch of this replica (or a padding pass): every stage runs it, the
    # first from token ids, the others from the previous stage's output, received over gloo or
    # NCCL; the last stage computes the log-probs. ``Round`` keeps what the backward needs.

    def _forward_round(
        self,
        model: nn.Module,
        packed: PackedBatch,
        rows: list[int],
        *,
        entropy: bool,
        value_head: nn.Module | None = None,
    ) -> dict[str, Any]:
        """This stage's part of one micro-batch: ``{"input", "output"}`` on a stage that hands
        on its activations, ``{"input", "out", "ent"}`` on the last, ``out`` the log-probs,
        or with a ``value_head`` (a critic's last stage) the values at the same positions.
        Runs with or without grad as the caller's context says. With ``share_prompts``, a
        group's prompt is one row followed by its responses
        (:func:`miles_trainer_common.layout.shared_layout`); else one right-padded row per
        sample under a causal mask."""
        if self.shared:
            layout = shared_layout(packed, rows)
            ids, position = layout.ids.to(self.device), layout.position.to(self.device)
            mask = (~layout.sees[:, None]).to(self.device)  # Megatron: True = not attended
            unit, pos, target, valid, first = (
                layout.unit,
                layout.pos,
                layout.target,
                layout.valid,
                layout.first,
            )
        else:
            index = torch.tensor(rows, dtype=torch.long)
            prompt = packed.prompt_lens[index]
            response = packed.response_lens[index]
            length = int((prompt + response).max())
            ids, position = packed.input_ids[index, :length].to(self.device), None
            mask = causal_mask(length, self.device)
            first = int(prompt.min()) - 1
            steps = torch.arange(max(1, int(response.max())))[None, :]
            valid = steps < response[:, None]
            pos = (prompt[:, None] - 1 + steps).clamp(max=length - 1)
            target = ids.cpu().gather(1, (pos + 1).clamp(max=length - 1))
            unit = torch.arange(len(rows))
        x = None
        if not self.first_stage:
            width = hidden_size(model)  # the policy's, or a critic's own
            x = torch.empty(ids.shape[1], ids.shape[0], width, device=self.device)
            dist.recv(x, src=self.prev_rank)
            x.requires_grad_(torch.is_grad_enabled())
        hidden = hidden_states(model, ids, mask, input_tensor=x, position=position)
        if not self.last_stage:
            dist.send(hidden.detach().contiguous(), dst=self.next_rank)
            return {"input": x, "output": hidden}
        if value_head is not None:
            values = values_at(
                value_head,
                hidden[first:],
                unit.to(self.device),
                (pos - first).to(self.device),
                valid.to(self.device),
            )
            return {"input": x, "out": values, "ent": None}
        logits = head(model, hidden[first:], invariant=self.true_on_policy)
        lp, ent = logprobs_at(
            logits,
            unit.to(self.device),
            (pos - first).to(self.device),
            target.to(self.device),
            valid.to(self.device),
            entropy=entropy,
        )
        return {"input": x, "out": lp, "ent": ent}

    def _backward_round(self, kept: dict[str, Any], g_lp: Tensor, g_ent: Tensor | None) -> None:
        """Backpropagate one round through this stage: from the loss's gradients with respect
        to the log-probs (and entropies), or a critic's values, on the last stage, from the
        next stage's gradient of this stage's output on the others; hand the input's gradient
        to the previous stage."""
        if self.last_stage:
            outputs = [kept["out"]]
            grads = [g_lp.to(self.device)]
            if g_ent is not None and kept["ent"] is not None:
                outputs.append(kept["ent"])
                grads.append(g_ent.to(self.device))
            torch.autograd.backward(outputs, grads)
        else:
            out = kept["output"]
            grad = torch.empty_like(out)
            dist.recv(grad, src=self.next_rank)
            if out.requires_grad:
                # (a first stage with nothing to train, the base frozen and no LoRA branch
                # there, has no graph: the gradient stops here)
                torch.autograd.backward([out], [grad])
        if not self.first_stage:
            x = kept["input"]
            dist.send(x.grad if x.grad is not None else torch.zeros_like(x), dst=self.prev_rank)

    def _gather_rounds(self, lp_full: Tensor, ent_full: Tensor, entropy: bool) -> None:
        """The last stage's log-probs to every stage, then each replica's rows to all."""
        if self.options.pipeline_parallel > 1:
            dist.broadcast(lp_full, src=self.last_rank, group=self.pp_group)
            if entropy:
                dist.broadcast(ent_full, src=self.last_rank, group=self.pp_group)
        if self.dp > 1:
            dist.all_reduce(lp_full, group=self.dp_group)
            if entropy:
                dist.all_reduce(ent_full, group=self.dp_group)

    def _forward_all(
        self,
        model: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        *,
        ent: bool,
        grad: bool = False,
        value_head: nn.Module | None = None,
    ) -> tuple[Tensor, Tensor, list[dict[str, Any]]]:
        """Log-probs (and entropies) ``[B, T]`` of the whole batch, on CPU, on every rank, or
        a critic's values with its ``value_head`` (on the last stage): each replica computes
        its micro-batches, a sum over replicas fills the rest (adding zeros is exact). With
        ``grad``, each round's graph is kept (returned) for the backward."""
        lp_full = torch.zeros(packed.size, packed.width, device=self.device)
        ent_full = torch.zeros(packed.size, packed.width, device=self.device)
        kept: list[dict[str, Any]] = []
        with torch.set_grad_enabled(grad):
            for i in range(rounds):
                rows = mine[i] if i < len(mine) else None
                out = self._forward_round(
                    model, packed, rows or [0], entropy=ent, value_head=value_head
                )
                if grad:
                    kept.append(out)
                if rows and self.last_stage:
                    index = torch.tensor(rows, device=self.device)
                    lp = out["out"].detach()
                    lp_full[index, : lp.shape[1]] = lp
                    if out["ent"] is not None:
                        ent_full[index, : lp.shape[1]] = out["ent"].detach()
        self._gather_rounds(lp_full, ent_full, ent)
        return lp_full.cpu(), ent_full.cpu(), kept

    def compute_logprobs(self, groups: list[Any]) -> tuple[Tensor, Tensor]:
        """Log-probs and entropies ``[B, T]`` of the response tokens, without grad; with
        several adapters each group's rows under the adapter it names."""
        model = self._ready()
        packed = pack(groups)
        split = by_adapter(groups, self.adapters, "megatron")
        if len(self.adapters) <= 1:
            mine, rounds, _ = self._plan(packed)
            lp, ent, _ = self._forward_all(model, packed, mine, rounds, ent=True)
            return lp, ent
        lp_full = torch.zeros(packed.size, packed.width)
        ent_full = torch.zeros(packed.size, packed.width)
        starts = [0]
        for group in groups:
            starts.append(starts[-1] + len(group.samples))
        for name, indices in split.items():
            self._activate(name)
            part = pack([groups[i] for i in indices])
            mine, rounds, _ = self._plan(part)
            lp, ent, _ = self._forward_all(model, part, mine, rounds, ent=True)
            rows = torch.tensor([r for i in indices for r in range(starts[i], starts[i + 1])])
            lp_full[rows, : part.width] = lp
            ent_full[rows, : part.width] = ent
        return lp_full, ent_full

    def _ref_logprobs(
        self, model: nn.Module, packed: PackedBatch, mine: list[list[int]], rounds: int
    ) -> Tensor:
        """The reference policy's log-probs: the initial checkpoint's, which with adapters is
        the policy with every adapter's LoRA branches off (no second model), else a frozen
        copy."""
        if self.adapters:
            with lora.disabled(model):
                return self._forward_all(model, packed, mine, rounds, ent=False)[0]
        if self.ref_model is None:
            self.ref_model = self._load(trainable=False)
        return self._forward_all(self.ref_model, packed, mine, rounds, ent=False)[0]

    def compute_values(self, groups: list[Any]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens, without grad (the critic is
        built first if no step has needed it)."""
        critic = self._critic_ready()
        packed = pack(groups)
        mine, rounds, _ = self._plan(packed)
        values, _, _ = self._forward_all(
            critic.body, packed, mine, rounds, ent=False, value_head=critic.value_head
        )
        return values

    # --- train ----------------------------------------------------------------------------

    def _grad_norm(self, named: list[tuple[str, nn.Parameter]]) -> float:
        """The global L2 norm of the gradients: tensor-parallel parts summed over the
        tensor-parallel group, parameters whole on every rank counted once."""
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in named:
            if p.grad is None or (self.tied_copies and name == "output_layer.weight"):
                continue  # the head's copy of a tied embedding is counted once, with it
            sq = p.grad.detach().double().pow(2).sum()
            if split_of(name) != "replicated":
                split += sq
            else:
                whole += sq
        if self.options.tensor_parallel > 1:
            dist.all_reduce(split, group=self.tp_group)
        total = split + whole
        if self.options.pipeline_parallel > 1:
            dist.all_reduce(total, group=self.pp_group)
        return float(total.sqrt())

    def train_step(self, groups: list[Any], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One update on ``groups``: the whole batch's log-probs (and, for an algorithm that
        needs values, the critic's), the algorithm's loss of them, its gradients pushed through
        the model (and the critic) one micro-batch at a time, gradients summed over replicas,
        clipped by the global norm, one AdamW step each. With several adapters, one update
        per adapter the groups name, in order of first appearance, on its groups alone (that
        adapter active, its optimizer and schedule); an adapter no group names is left
        untouched. Its metrics are then each adapter's as ``<name>/<key>``, and the totals
        (:data:`~miles_trainer_common.controller.TOTALS`) unprefixed."""
        model = self._ready()
        needs = check_algorithm(algorithm, SUPPORTED_NEEDS, "megatron", len(self.adapters))
        metrics = train_by_adapter(
            groups,
            self.adapters,
            "megatron",
            lambda part, key, start: self._train_on(model, part, algorithm, needs, key, start),
            self._activate,
        )
        self.step += 1
        metrics["step"] = float(self.step)
        return metrics

    def _train_on(
        self,
        model: nn.Module,
        groups: list[Any],
        algorithm: AlgorithmImpl,
        needs: frozenset[str],
        key: str,
        start: float,
    ) -> dict[str, float]:
        """One update of optimizer ``key`` (an adapter's name; "" for the whole model) on
        ``groups``, the adapter already active; its metrics, but ``step``."""
        optimizer, scheduler = self.optimizers[key], self.schedulers[key]
        critic = self._critic_ready() if "values" in needs else None
        packed = pack(groups)
        batch = make_token_batch(packed)
        mine, rounds, n_micro = self._plan(packed)

        if self.sharded is not None:
            self.sharded.zero_grad()  # its buffer, and its inner optimizer's shards
        else:
            optimizer.zero_grad(set_to_none=True)
        keep = self.options.keep_activations
        lp, ent, kept = self._forward_all(model, packed, mine, rounds, ent=True, grad=keep)
        if self.true_on_policy:
            check_on_policy(lp, packed.rollout_logprobs, packed.response_mask, packed.group_index)
        if "old_logprobs" in needs:
            batch.old_logprobs = lp.clone()
        if "ref_logprobs" in needs:
            batch.ref_logprobs = self._ref_logprobs(model, packed, mine, rounds)
        # The critic's values before its update: the baseline of GAE and the centre of the
        # value clipping; with keep_activations their graphs serve the critic's backward.
        values: Tensor | None = None
        kept_values: list[dict[str, Any]] = []
        if critic is not None:
            assert self.critic_optimizer is not None
            self.critic_optimizer.zero_grad(set_to_none=True)
            values, _, kept_values = self._forward_all(
                critic.body,
                packed,
                mine,
                rounds,
                ent=False,
                grad=keep,
                value_head=critic.value_head,
            )
            batch.values = values.clone()
        algorithm.compute_advantages(batch)

        # The loss of the whole batch as a function of its log-probs and entropies (and the
        # critic's values); its gradient with respect to them is pushed through the model (and
        # the critic) one micro-batch at a time, so any aggregation is exactly that of one big
        # batch, whatever the split.
        lp_leaf = lp.clone().requires_grad_(True)
        ent_leaf = ent.clone().requires_grad_(True)
        leaves = [lp_leaf, ent_leaf]
        if values is not None:
            v_leaf = values.clone().requires_grad_(True)
            leaves.append(v_leaf)
            loss, algo_metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf, values=v_leaf)
        else:
            loss, algo_metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf)
        grads: list[Tensor | None] = [None] * len(leaves)
        if loss.requires_grad:
            grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
        g_lp, g_ent = grads[0], grads[1]
        if g_lp is None:
            g_lp = torch.zeros_like(lp)

        self._backward_all(model, None, packed, mine, rounds, kept, g_lp, g_ent)
        named = self.trained[key]
        self._reduce_grads(named, tied=self.tied_copies, sharded=self.sharded)
        grad_norm, lr, skipped = self._clip_and_step(
            named, optimizer, scheduler, self.options.max_grad_norm, sharded=self.sharded
        )

        critic_metrics: dict[str, float] = {}
        if critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            g_v = grads[2] if grads[2] is not None else torch.zeros_like(lp)
            self._backward_all(
                critic.body, critic.value_head, packed, mine, rounds, kept_values, g_v, None
            )
            c_named = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
            self._reduce_grads(c_named, tied=False)
            if self.options.tensor_parallel > 1 and critic.value_head is not None:
                # Every tensor-parallel rank computes the head's gradient from the same hidden
                # states and the same value gradient; taking the first rank's keeps the heads
                # bitwise equal whatever the kernels do.
                from megatron.core import parallel_state as ps

                src = ps.get_tensor_model_parallel_src_rank()
                for p in critic.value_head.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.broadcast(p.grad, src=src, group=self.tp_group)
            c_norm, c_lr, c_skipped = self._clip_and_step(
                c_named,
                self.critic_optimizer,
                self.critic_scheduler,
                self.options.critic.max_grad_norm,
            )
            critic_metrics = {
                "critic/grad_norm": c_norm,
                "critic/lr": c_lr,
                "critic/skipped_nonfinite": float(c_skipped),
            }
        elapsed = time.perf_counter() - start
        tokens = int(packed.seq_lens.sum())
        metrics = {k: float(v) for k, v in algo_metrics.items()}
        metrics.update(
            {
                "grad_norm": grad_norm,
                "lr": lr,
                "step_time_s": elapsed,
                "tokens": float(tokens),
                "response_tokens": float(packed.response_mask.sum()),
                "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "micro_batches": float(n_micro),
                "skipped_nonfinite": float(skipped),
            }
        )
        metrics.update(critic_metrics)
        return metrics

    def _backward_all(
        self,
        model: nn.Module,
        value_head: nn.Module | None,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        kept: list[dict[str, Any]],
        g_out: Tensor,
        g_ent: Tensor | None,
    ) -> None:
        """Push the loss's gradient with respect to the log-probs (and entropies), or with a
        ``value_head`` the critic's values, through ``model`` one round at a time: each
        round's kept forward (``keep_activations``), else a forward with grad first."""
        for i in range(rounds):
            rows = mine[i] if i < len(mine) else None
            run = rows or [0]
            if kept:
                # This round's kept forward; popped so its activations go with its backward.
                round_ = kept.pop(0)
            else:
                round_ = self._forward_round(
                    model, packed, run, entropy=g_ent is not None, value_head=value_head
                )
            index = torch.tensor(run)
            width = int(packed.response_lens[index].max()) if self.last_stage else 0
            width = max(1, width)
            scale = 1.0 if rows else 0.0
            g_ent_mb = None if g_ent is None else g_ent[index, :width] * scale
            self._backward_round(round_, g_out[index, :width] * scale, g_ent_mb)

    def _reduce_grads(
        self,
        named: list[tuple[str, nn.Parameter]],
        *,
        tied: bool,
        sharded: DistributedAdam | None = None,
    ) -> None:
        """Complete each gradient before the norm: QK-norm parts summed over the
        tensor-parallel group, a tied embedding's two copies (``tied``) summed, replicas
        summed. With ``sharded`` (Megatron's distributed optimizer), the gradients are in its
        buffer (``param.main_grad``) and the replicas' sum is its reduce-scatter."""

        def grad(p: nn.Parameter) -> Tensor:
            if sharded is not None:
                return p.main_grad  # type: ignore[attr-defined,no-any-return]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            return p.grad

        if self.options.tensor_parallel > 1:
            # QK-norm weights are whole on every rank but each rank normalises only its own
            # heads: each holds part of their gradient, which is summed over the group.
            for name, p in named:
                if name.endswith(("q_layernorm.weight", "k_layernorm.weight")) and (
                    sharded is not None or p.grad is not None
                ):
                    dist.all_reduce(grad(p), group=self.tp_group)
        if tied:
            # The embedding (first stage) and the head (last stage) are one tied weight kept
            # as two copies: each gets the sum of both gradients.
            for name, p in named:
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    dist.all_reduce(grad(p), group=self.embedding_group)
        if sharded is not None:
            sharded.reduce()
            return
        if self.options.tensor_parallel > 1 and self.adapters:
            # A LoRA tensor whole on every tensor-parallel rank gets the same gradient on each
            # (its branch's collectives make it whole); taking the first rank's keeps the
            # copies bitwise equal whatever the kernels do.
            from megatron.core import parallel_state as ps

            src = ps.get_tensor_model_parallel_src_rank()
            for name, p in named:
                if lora.lora_split(name) == "replicated":
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.broadcast(p.grad, src=src, group=self.tp_group)
        if self.dp > 1:
            for _, p in named:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.dp_group)

    def _clip_and_step(
        self,
        named: list[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        max_norm: float | None,
        sharded: DistributedAdam | None = None,
    ) -> tuple[float, float, bool]:
        """Clip by the global norm, one AdamW step (skipped on a non-finite gradient, which
        would poison its moments), one schedule step; returns ``(norm, lr, skipped)``. With
        ``sharded``, its norm, clipping and step (the same rule, over the shards)."""
        if sharded is not None:
            lr = float(scheduler.get_last_lr()[0])
            grad_norm, skipped = sharded.step(max_norm)
            scheduler.step()
            return grad_norm, lr, skipped
        grad_norm = self._grad_norm(named)
        if max_norm is not None and math.isfinite(grad_norm):
            coef = max_norm / (grad_norm + 1e-6)
            if coef < 1.0:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        lr = float(scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
        scheduler.step()
        return grad_norm, lr, skipped

    # --- weights --------------------------------------------------------------------------

    def _whole(self, params: dict[str, Tensor], name: str) -> Tensor:
        """The whole Megatron tensor ``name``, gathered from the tensor-parallel ranks."""
        local = params[spec_name(name, params)].detach()
        tp = self.options.tensor_parallel
        if tp == 1 or split_of(name) == "replicated":
            return local
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return unshard(parts, split_of(name))

    def _stages(
        self,
        produce: Callable[[int], Iterator[tuple[str, Tensor]]],
        names: Callable[[int], list[tuple[str, tuple[int, ...]]]],
        device: str | None,
    ) -> Iterator[tuple[str, Tensor]]:
        """Collective: the (name, whole tensor) pairs ``produce(stage)`` gives on each stage's
        ranks, stage after stage, yielded on rank 0 (the other ranks yield ``names(stage)``
        with empty placeholders, in step): a later stage's tensors are sent to rank 0 one at a
        time by that stage's first rank. In the options' ``export_dtype``, on ``device``."""
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.options.export_dtype or "")
        placeholder = torch.empty(0)

        def out(tensor: Tensor) -> Tensor:
            # A consumer that keeps the tensor must not see it change at the next step.
            t = tensor.detach().clone()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.to(device) if device is not None else t

        for stage in range(self.options.pipeline_parallel):
            owner = stage * self.options.tensor_parallel * self.dp
            if stage == self.pp_rank:
                for name, tensor in produce(stage):
                    if stage > 0 and self.rank == owner:
                        dist.send(tensor.detach().contiguous(), dst=0)
                    yield name, out(tensor)
            elif self.rank == 0:
                for name, shape in names(stage):
                    tensor = torch.empty(shape, device=self.device)
                    dist.recv(tensor, src=owner)
                    yield name, out(tensor)
            else:
                for name, _ in names(stage):
                    yield name, placeholder

    def _base_names(self, stage: int) -> list[tuple[str, tuple[int, ...]]]:
        assert self.shape is not None
        shapes = hf_shapes(self.shape)
        return [
            (n, tuple(shapes[n]))
            for n in stage_hf_names(self.shape, stage, self.options.pipeline_parallel)
        ]

    def _base_stage(self, stage: int) -> Iterator[tuple[str, Tensor]]:
        """This stage's Hugging Face tensors, whole (tensor-parallel parts gathered a decoder
        layer at a time)."""
        model = self._ready()
        assert self.shape is not None
        params = dict(model.state_dict(keep_vars=True))
        yield from hf_stage(
            lambda n: self._whole(params, n), self.shape, stage, self.options.pipeline_parallel
        )

    def _lora_names(self, adapter: Any, stage: int) -> list[tuple[str, tuple[int, ...]]]:
        """PEFT's (name, shape) of ``adapter``'s tensors on ``stage``, in the Hugging Face
        model's order (per module: A, then B)."""
        assert self.shape is not None
        r = adapter.options.rank
        layers = stage_layers(self.shape, stage, self.options.pipeline_parallel)
        out: list[tuple[str, tuple[int, ...]]] = []
        for t in self.lora_targets[adapter.name]:
            if t.layer in layers:
                out.append((adapter.peft_name(t.module, "lora_A"), (r, t.in_features)))
                out.append((adapter.peft_name(t.module, "lora_B"), (t.out_features, r)))
        return out

    def _lora_stage(self, adapter: Any, stage: int) -> Iterator[tuple[str, Tensor]]:
        """This stage's tensors of ``adapter``, whole, in PEFT's names (:meth:`_lora_names`)."""
        model = self._ready()
        assert self.shape is not None
        params = dict(model.state_dict(keep_vars=True))
        layers = stage_layers(self.shape, stage, self.options.pipeline_parallel)
        for t in self.lora_targets[adapter.name]:
            if t.layer in layers:
                a, b = lora.megatron_names(t, layers, adapter.name)
                yield adapter.peft_name(t.module, "lora_A"), self._whole(params, a)
                yield adapter.peft_name(t.module, "lora_B"), self._whole(params, b)

    def _merged_stage(self, adapter: Any, stage: int) -> Iterator[tuple[str, Tensor]]:
        """This stage's Hugging Face tensors with ``adapter`` (alone) merged in: ``W + scaling
        * B @ A`` in float32, cast back to ``W``'s dtype (as ``LoraAdapter.merged_weights``)."""
        scaling = adapter.options.scaling()
        weights = dict(self._lora_stage(adapter, stage))
        for name, w in self._base_stage(stage):
            module = name.removesuffix(".weight")
            a_name = adapter.peft_name(module, "lora_A")
            if a_name in weights:
                a, b = weights[a_name], weights[adapter.peft_name(module, "lora_B")]
                delta = (b.float() @ a.float()) * scaling
                w = (w.float() + delta).to(w.dtype)
            yield name, w

    def _adapter(self, name: str | None) -> Any:
        return pick_adapter(self.adapters, name, "megatron")

    def export_tensors(
        self, device: str | None = None, adapter: str | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Collective: every (Hugging Face name, whole tensor), one at a time, yielded on rank
        0 (the other ranks yield the same names with empty placeholders, in step); with
        adapters, the tensors of the adapter named ``adapter`` (``None``: the only one) alone,
        in PEFT's names (what the engines load). Tensor-parallel parts are gathered a decoder
        layer at a time; a later pipeline stage's tensors are sent to rank 0 one at a time by
        that stage's first rank."""
        self._ready()
        if self.adapters:
            impl = self._adapter(adapter)
            return self._stages(
                functools.partial(self._lora_stage, impl),
                functools.partial(self._lora_names, impl),
                device,
            )
        if adapter is not None:
            self._adapter(adapter)  # raises: there is no adapter
        return self._stages(self._base_stage, self._base_names, device)

    def export_model(
        self, device: str | None = None, adapter: str | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Collective: the whole policy as plain Hugging Face weights, the adapter named
        ``adapter`` (``None``: the only one) merged in, no other adapter (without adapters,
        :meth:`export_tensors`)."""
        self._ready()
        if not self.adapters:
            return self.export_tensors(device, adapter)
        impl = self._adapter(adapter)
        return self._stages(functools.partial(self._merged_stage, impl), self._base_names, device)

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """Collective: the adapter named ``adapter`` (``None``: the only one) in PEFT's format
        under ``path``, written by rank 0."""
        self._ready()
        if not self.adapters:
            raise RuntimeError("save_adapter: this megatron trainer has no adapter")
        impl = self._adapter(adapter)
        weights = list(self.export_tensors("cpu", impl.name))
        if self.rank == 0:
            impl.save_pretrained(weights, path)
        dist.barrier()

    def _hash_parts(self, h: Any) -> str:
        """Collective: one sha256 over every rank's hex digest ``h``, in rank order."""
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, h.hexdigest())
        return hashlib.sha256("".join(parts).encode()).hexdigest()

    @staticmethod
    def _hash_optimizer(
        h: Any,
        params: list[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
    ) -> None:
        """Add the optimizer's state of ``params`` and the schedule's state to ``h``."""
        for name, param in params:
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                h.update(f"{name}/{key}".encode())
                v = state[key]
                if isinstance(v, Tensor):
                    hash_tensor(h, v)
                else:
                    h.update(repr(v).encode())
        h.update(repr(scheduler.state_dict()).encode())

    def optimizer_state_elements(self) -> int:
        """How many elements of optimizer state (Adam's moments) of the policy this rank holds:
        twice its parameters with AdamW, twice its shard of them with the distributed
        optimizer."""
        return sum(
            v.numel()
            for optimizer in self.optimizers.values()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor) and v.dim() > 0
        )

    def fingerprint(self) -> dict[str, str]:
        """Collective: sha256 of the whole weights (Hugging Face naming; with adapters, the
        frozen base's) and of every rank's state of every optimizer and schedule
        (``optimizer``); with adapters, of each adapter's whole tensors (``adapter/<name>``)
        and of every rank's state of its optimizer and schedule (``optimizer/<name>``); once
        a critic exists, also of every rank's part of the critic (``critic``) and of its
        optimizer and schedule (``critic_optimizer``)."""
        model = self._ready()
        weights = hashlib.sha256()
        for name, tensor in self._stages(self._base_stage, self._base_names, None):
            weights.update(name.encode())
            hash_tensor(weights, tensor)
        named = list(model.named_parameters())
        if self.sharded is not None:
            named = self.sharded.named_state_params()  # its state is keyed by the shards
        optim = hashlib.sha256()
        for key, optimizer in self.optimizers.items():
            self._hash_optimizer(optim, named, optimizer, self.schedulers[key])
        optim.update(f"step={self.step}".encode())
        out = {"weights": weights.hexdigest(), "optimizer": self._hash_parts(optim)}
        for adapter in self.adapters:
            h = hashlib.sha256()
            for name, tensor in self.export_tensors(adapter=adapter.name):
                h.update(name.encode())
                hash_tensor(h, tensor)
            out[f"adapter/{adapter.name}"] = h.hexdigest()
            own = hashlib.sha256()
            self._hash_optimizer(
                own,
                self.trained[adapter.name],
                self.optimizers[adapter.name],
                self.schedulers[adapter.name],
            )
            out[f"optimizer/{adapter.name}"] = self._hash_parts(own)
        if self.critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            critic_weights = hashlib.sha256()
            for name, tensor in self.critic.state_dict().items():
                if isinstance(tensor, Tensor):
                    critic_weights.update(name.encode())
                    hash_tensor(critic_weights, tensor)
            critic_optim = hashlib.sha256()
            self._hash_optimizer(
                critic_optim,
                list(self.critic.named_parameters()),
                self.critic_optimizer,
                self.critic_scheduler,
            )
            out["critic"] = self._hash_parts(critic_weights)
            out["critic_optimizer"] = self._hash_parts(critic_optim)
        return out

    # --- checkpoints ----------------------------------------------------------------------

    def _layout(self) -> dict[str, int]:
        o = self.options
        return {
            "tensor_parallel": o.tensor_parallel,
            "pipeline_parallel": o.pipeline_parallel,
            "data_parallel": o.data_parallel,
        }

    def save(self, path: str, extra: dict[str, Any], weight_version: int) -> None:
        """Collective: every rank's model part (with adapters, their LoRA tensors alone: the
        frozen base is re-read from ``model_path``), the state of every optimizer (by adapter
        name; "" for the whole model) and RNG states (and, once a critic exists, its part of
        the critic and the critic's optimizer state) in its own file; on rank 0 the schedules,
        step, weight version, layout, the adapters' configs and ``extra``."""
        model = self._ready()
        os.makedirs(path, exist_ok=True)
        own: dict[str, Any] = {
            # with adapters, their tensors alone: the frozen base is re-read from model_path
            "model": _tensors(model, lora_only=bool(self.adapters)),
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "rng": rng_state(self.device),
        }
        critic_meta: dict[str, Any] | None = None
        if self.critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            own["critic"] = _tensors(self.critic)
            own["critic_optimizer"] = self.critic_optimizer.state_dict()
            critic_meta = {"scheduler": self.critic_scheduler.state_dict()}
        torch.save(own, os.path.join(path, f"rank{self.rank}.pt"))
        if self.rank == 0:
            torch.save(
                {
                    "step": self.step,
                    "weight_version": weight_version,
                    # by adapter name ("" for the whole model)
                    "schedulers": {k: s.state_dict() for k, s in self.schedulers.items()},
                    "critic": critic_meta,
                    "extra": extra,
                    "layout": self._layout(),
                    "model_path": self.model_path,
                    "options": self.options.model_dump(mode="json"),
                    "adapters": self._adapter_configs(),
                },
                os.path.join(path, "trainer.pt"),
            )
        dist.barrier()

    def load(self, path: str) -> tuple[dict[str, Any], int]:
        """Collective: restore what :meth:`save` wrote (same layout); returns ``(extra,
        weight_version)``."""
        model = self._ready()
        trainer_file = os.path.join(path, "trainer.pt")
        if not os.path.exists(trainer_file):
            raise FileNotFoundError(f"{path} holds no megatron checkpoint (no trainer.pt)")
        # Tensors and plain values only: resuming a checkpoint someone else wrote must not run
        # their code.
        meta = load_checkpoint_file(trainer_file)
        if meta["layout"] != self._layout():
            raise ValueError(
                f"the checkpoint at {path} was saved with layout {meta['layout']}; this trainer "
                f"has {self._layout()} (resume with the same tensor/pipeline/data parallel)"
            )
        saved_sharded = bool(meta.get("options", {}).get("distributed_optimizer", False))
        if saved_sharded != self.options.distributed_optimizer:
            raise ValueError(
                f"the checkpoint at {path} was saved with backend.distributed_optimizer="
                f"{str(saved_sharded).lower()}; this trainer has "
                f"{str(self.options.distributed_optimizer).lower()} (its optimizer state is "
                "laid out for that one: resume with the same)"
            )
        saved_adapters = meta.get("adapters", {})
        if saved_adapters != self._adapter_configs():
            raise ValueError(
                f"{path} was saved by a megatron trainer with adapters "
                f"{saved_adapters or 'none'}, and this one has {self._adapter_configs() or 'none'}"
                ": a checkpoint resumes only with the adapters (their served_name and adapter "
                "options) it was saved with"
            )
        own = load_checkpoint_file(os.path.join(path, f"rank{self.rank}.pt"))
        if "optimizers" in own:
            optimizers, schedulers = own["optimizers"], meta["schedulers"]
        else:  # written before a trainer held several adapters: one optimizer
            (key,) = self.optimizers
            optimizers, schedulers = {key: own["optimizer"]}, {key: meta["scheduler"]}
        self._load_tensors(model, own["model"], path, lora_only=bool(self.adapters))
        for key, optimizer in self.optimizers.items():
            optimizer.load_state_dict(optimizers[key])
            self.schedulers[key].load_state_dict(schedulers[key])
        critic_meta = meta.get("critic")
        if critic_meta is None:
            # Saved before any critic existed: the next step that needs one builds it fresh,
            # as the saved trainer would have.
            self.critic = None
            self.critic_optimizer = self.critic_scheduler = None
        else:
            critic = self.critic if self.critic is not None else self._build_critic()
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            self._load_tensors(critic, own["critic"], path)
            self.critic_optimizer.load_state_dict(own["critic_optimizer"])
            self.critic_scheduler.load_state_dict(critic_meta["scheduler"])
        self.step = int(meta["step"])
        set_rng_state(own["rng"], self.device)
        dist.barrier()
        return dict(meta["extra"]), int(meta["weight_version"])

    def _adapter_configs(self) -> dict[str, dict[str, Any]]:
        """Each adapter's ``engine_config`` by its name."""
        return {a.name: a.engine_config() for a in self.adapters}

    def _load_tensors(
        self, model: nn.Module, tensors: dict[str, Tensor], path: str, *, lora_only: bool = False
    ) -> None:
        with torch.no_grad():
            result = model.load_state_dict(
                {k: v.to(self.device) for k, v in tensors.items()}, strict=False
            )
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if lora_only:
            missing = [k for k in missing if lora.lora_split(k) is not None]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"the checkpoint at {path} does not fit this model: missing {missing}, "
                f"unexpected {result.unexpected_keys}"
            )

    # --- placement ------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free gradients; on a GPU move parameters and optimizer state (the policy's, every
        adapter's, the reference model's and the critic's) to the CPU."""
        self._ready()
        models = [self.model, self.ref_model, self.critic]
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
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
        shared.sleep(optimizers, models, self.device)
        self.asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if self.model is None:
            raise RuntimeError("the megatron trainer is not set up: call setup(model_path) first")
        if not self.asleep:
            return
        models = [self.model, self.ref_model, self.critic]
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
        if self.sharded is not None and self.device.type == "cuda":
            models[0] = None
            self.sharded.reload()
        shared.wake(optimizers, models, self.device)
        self.asleep = False


def _tensors(model: nn.Module, *, lora_only: bool = False) -> dict[str, Tensor]:
    """``model``'s state on the CPU (Megatron lists ``_extra_state`` entries, None without
    Transformer Engine: left out); ``lora_only``: its LoRA tensors alone."""
    return {
        k: v.detach().cpu()
        for k, v in model.state_dict().items()
        if isinstance(v, Tensor) and (not lora_only or lora.lora_split(k) is not None)
    }
