"""One rank of the FSDP2 trainer: the sharded model, its optimizer, and every operation.

The same class runs in-process (world size 1, a real one-rank gloo/NCCL group) and in each
spawned worker process (world size N). Every method that runs the model is collective: all
ranks call it with the same arguments and perform the same number of forward passes (a rank
with fewer micro-batches runs padding passes whose results are discarded), because FSDP2
all-gathers parameters in every forward.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import warnings
from collections.abc import Iterator
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
from miles_trainer_common.logprobs import check_on_policy
from miles_trainer_common.rank import adamw, check_algorithm, seed_everything
from miles_trainer_common.routing import RoutingReplay
from miles_trainer_common.schedule import LRSchedule
from miles_trainer_common.state import (
    check_sharded_checkpoint,
    hash_tensor,
    load_checkpoint_file,
    plain_load_planner,
    rng_state,
    set_rng_state,
)
from torch import Tensor, nn

from miles_backend_fsdp2.model import (
    load_sharded,
    token_logprobs,
    token_logprobs_shared,
    token_values,
    token_values_shared,
)
from miles_backend_fsdp2.options import SUPPORTED_NEEDS, FSDP2Options
from miles_core.contracts import AlgorithmImpl
from miles_core.invariant.kernels import TILE, invariant_mode, prepare


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    max_norm: float | None,
) -> tuple[float, float, bool]:
    """Clip the global gradient norm of the optimizer's parameters, step AdamW (unless the
    norm is not finite) and the LR schedule; returns ``(grad_norm, lr used, skipped)``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    grad_norm = float(_full(norm))
    lr = float(scheduler.get_last_lr()[0])
    skipped = not math.isfinite(grad_norm)
    if skipped:
        # A non-finite gradient would poison AdamW's moments: drop this update.
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    scheduler.step()
    return grad_norm, lr, skipped


def _hash_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[torch.optim.lr_scheduler.LambdaLR],
    suffix: bytes = b"",
) -> tuple[str, str]:
    """Collective: sha256 of the full weights, and of the full state of the optimizers and
    schedules."""
    weights = hashlib.sha256()
    for name, value in model.state_dict().items():
        weights.update(name.encode())
        hash_tensor(weights, _full(value))
    return weights.hexdigest(), _hash_optim(
        list(model.named_parameters()), optimizers, schedulers, suffix
    )


def _hash_optim(
    params: list[tuple[str, nn.Parameter]],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[torch.optim.lr_scheduler.LambdaLR],
    suffix: bytes = b"",
) -> str:
    """Collective: sha256 of the optimizers' full state of ``params`` and the schedules'."""
    optim = hashlib.sha256()
    states: dict[Any, Any] = {}
    for optimizer in optimizers:
        states.update(optimizer.state)
    for name, param in params:
        state = states.get(param, {})
        for key in sorted(state):
            optim.update(f"{name}/{key}".encode())
            v = state[key]
            if isinstance(v, Tensor):
                hash_tensor(optim, _full(v))
            else:
                optim.update(repr(v).encode())
    for scheduler in schedulers:
        optim.update(repr(scheduler.state_dict()).encode())
    optim.update(suffix)
    return optim.hexdigest()


class RankWorker:
    """The state and operations of one rank (see the module docstring)."""

    def __init__(
        self,
        options: FSDP2Options,
        rank: int,
        world_size: int,
        store_path: str | None = None,
        adapter: Any = None,
        adapters: Any = None,
        routing: str = "none",
        true_on_policy: bool = False,
    ) -> None:
        self.options = options
        #: the run's ``rollout.true_on_policy``: the policy's forward runs the batch-invariant
        #: kernels, and a step whose log-probs differ from the engine's fails
        self.true_on_policy = true_on_policy
        #: with ``share_prompts`` in true on-policy mode, a group shares only its prompt's whole
        #: key tiles, so that every key lies where the engine's cache holds it
        #: (see ``token_logprobs_shared``)
        self._tile = TILE if true_on_policy else None
        #: the run's ``rollout.routing``: ``record`` or ``replay`` hooks the routers of the
        #: policy (and of the reference model, which replays the same record)
        self.routing = routing
        self._routers: dict[int, RoutingReplay] = {}
        #: the run's adapters (``miles_core.contracts.AdapterImpl``, distinct names): the
        #: policy is wrapped in all of them, only their weights train (each with its own
        #: optimizer, on the groups that name it) and are exported; empty: full fine-tuning.
        #: ``adapter=x`` is ``adapters=[x]``.
        self.adapters: list[Any] = (
            list(adapters) if adapters is not None else [adapter] if adapter is not None else []
        )
        self.rank = rank
        self.world_size = world_size
        if options.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device 'cuda' was asked but torch sees no CUDA device")
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            self.device = torch.device("cpu")
            threads = options.cpu_threads or max(1, (os.cpu_count() or 1) // world_size)
            torch.set_num_threads(threads)
            backend = "gloo"
        timeout = timedelta(seconds=options.timeout_s)
        if store_path is None:
            # In-process: a real one-rank group, so the FSDP2 collectives run as they do at N.
            if not dist.is_initialized():
                dist.init_process_group(
                    backend,
                    store=dist.HashStore(),  # type: ignore[attr-defined]
                    rank=0,
                    world_size=1,
                    timeout=timeout,
                )
            elif dist.get_world_size() != 1:
                raise RuntimeError(
                    "an in-process fsdp2 trainer (world_size 1) needs this process to have no "
                    f"default process group or one of size 1; it has {dist.get_world_size()}"
                )
        else:
            dist.init_process_group(
                backend,
                store=dist.FileStore(store_path, world_size),  # type: ignore[attr-defined]
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.model: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        # One AdamW and LR schedule per adapter, by its name (full fine-tuning: one, by "").
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        # Every adapter's parameters (kept trainable: see _keep_trainable)
        self._adapter_params: list[nn.Parameter] = []
        # The critic (value model) and its own optimizer and schedule: built the first time an
        # algorithm needs values (or a checkpoint holds them).
        self.critic: nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.model_path = ""
        self.step = 0
        self.asleep = False

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
        seed_everything(self.options.seed)
        self.model_path = model_path
        # With adapters only the policy is wrapped: the critic (PPO) stays a full model,
        # fully fine-tuned, and the reference is the policy with its adapters disabled.
        model = self.model = self._load(trainable=True, adapters=self.adapters)
        if self.routing != "none":
            self._routers[id(model)] = RoutingReplay(model, self.routing)
        o = self.options
        units: dict[str, tuple[list[nn.Parameter], float | None]] = {}
        if not self.adapters:
            units[""] = (list(model.parameters()), None)
        for adapter in self.adapters:
            params = [p for _, p in adapter.parameters(model)]
            if not params:
                raise RuntimeError(f"adapter {adapter.name!r} has no parameter in the model")
            units[adapter.name] = (params, adapter.lr)
            self._adapter_params += params
        self._keep_trainable()
        self.optimizers, self.schedulers = {}, {}
        for key, (params, lr) in units.items():
            optimizer = adamw(params, o, lr=lr)
            schedule = LRSchedule(o.warmup_steps, o.lr_schedule, o.decay_steps, o.min_lr_ratio)
            self.optimizers[key] = optimizer
            self.schedulers[key] = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        self.step = 0

    def _keep_trainable(self) -> None:
        """Every adapter's parameters trainable again: peft's ``set_adapter`` and
        ``disable_adapter`` freeze the inactive adapters, and a frozen one would be left out
        of the checkpoint (``ignore_frozen_params``). An inactive adapter takes no part in
        the forward, so it gets no gradient (and FSDP2 reduces none) all the same."""
        for p in self._adapter_params:
            p.requires_grad_(True)

    def _activate(self, name: str) -> None:
        """Adapter ``name`` applies in the policy's forward (with several adapters)."""
        if len(self.adapters) > 1:
            assert self.model is not None
            pick_adapter(self.adapters, name, "fsdp2").activate(self.model)
            self._keep_trainable()

    def _build_critic(self) -> nn.Module:
        """The critic on ``critic.path`` (default: the policy's checkpoint), its AdamW and LR
        schedule. Its new value head is drawn from a generator seeded with ``seed`` alone, so
        the critic is the same whenever it is built and the run's RNG stream is untouched."""
        o = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(o.seed)
            critic = self._load(trainable=True, value=True, path=o.critic.path)
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

    def _critic_ready(self) -> nn.Module:
        self._ready()
        return self.critic if self.critic is not None else self._build_critic()

    def _ready(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the fsdp2 trainer is not set up: call setup(model_path) first")
        if self.asleep:
            raise RuntimeError("the fsdp2 trainer is asleep: call wake() first")
        return self.model

    # --- forward ------------------------------------------------------------------------

    def _plan(self, packed: PackedBatch) -> tuple[list[list[int]], int, int]:
        lens = packed.seq_lens.tolist()
        budget = self.options.micro_batch_tokens
        if self.options.share_prompts:
            plan = plan_groups(packed, budget)
        else:
            plan = plan_by_length(lens, budget)
        per_rank = assign_to_ranks(plan, lens, self.world_size)
        return per_rank[self.rank], max(len(m) for m in per_rank), len(plan)

    def _logprobs(
        self, model: nn.Module, packed: PackedBatch, rows: list[int], *, entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        routing = self._routers.get(id(model))
        with invariant_mode(self.true_on_policy):
            if self.options.share_prompts:
                return token_logprobs_shared(
                    model, packed, rows, entropy=entropy, routing=routing, tile=self._tile
                )
            return token_logprobs(model, packed, rows, entropy=entropy, routing=routing)

    def _forward_all(
        self,
        model: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        *,
        ent: bool,
    ) -> tuple[Tensor, Tensor]:
        """No-grad log-probs (and entropies) ``[B, T]`` of the whole batch, on CPU: each rank
        computes its micro-batches, then a sum over ranks fills the rest (adding zeros is
        exact)."""
        lp_full = torch.zeros(packed.size, packed.width, device=self.device)
        ent_full = torch.zeros(packed.size, packed.width, device=self.device)
        with torch.no_grad():
            for i in range(rounds):
                rows = mine[i] if i < len(mine) else None
                lp, en = self._logprobs(model, packed, rows or [0], entropy=ent)
                if rows:
                    index = torch.tensor(rows, device=self.device)
                    lp_full[index, : lp.shape[1]] = lp
                    if en is not None:
                        ent_full[index, : en.shape[1]] = en
        if self.world_size > 1:
            dist.all_reduce(lp_full)
            if ent:
                dist.all_reduce(ent_full)
        return lp_full.cpu(), ent_full.cpu()

    def _forward_with_grad(
        self, model: nn.Module, packed: PackedBatch, mine: list[list[int]], rounds: int
    ) -> tuple[Tensor, Tensor, list[tuple[list[int] | None, Tensor, Tensor | None]]]:
        """Log-probs and entropies ``[B, T]`` of the whole batch (detached, on CPU, as
        :meth:`_forward_all` gives them) and, per round, the rows and the micro-batch's outputs
        with their autograd graphs, kept for the backward pass."""
        lp_full = torch.zeros(packed.size, packed.width, device=self.device)
        ent_full = torch.zeros(packed.size, packed.width, device=self.device)
        graphs: list[tuple[list[int] | None, Tensor, Tensor | None]] = []
        for i in range(rounds):
            rows = mine[i] if i < len(mine) else None
            lp, en = self._logprobs(model, packed, rows or [0], entropy=True)
            graphs.append((rows, lp, en))
            if rows:
                index = torch.tensor(rows, device=self.device)
                lp_full[index, : lp.shape[1]] = lp.detach()
                if en is not None:
                    ent_full[index, : en.shape[1]] = en.detach()
        if self.world_size > 1:
            dist.all_reduce(lp_full)
            dist.all_reduce(ent_full)
        return lp_full.cpu(), ent_full.cpu(), graphs

    def _ref_logprobs(
        self, model: nn.Module, packed: PackedBatch, mine: list[list[int]], rounds: int
    ) -> Tensor:
        """The reference policy's log-probs: the initial checkpoint's, which with adapters is
        the policy with its adapters disabled (no second model), else a frozen copy."""
        if self.adapters:
            try:
                with model.disable_adapter():  # type: ignore[operator]
                    return self._forward_all(model, packed, mine, rounds, ent=False)[0]
            finally:
                self._keep_trainable()
        if self.ref_model is None:
            self.ref_model = self._load(trainable=False)
            if self.routing != "none":
                self._routers[id(self.ref_model)] = RoutingReplay(
                    self.ref_model, self.routing, measure=False
                )
        return self._forward_all(self.ref_model, packed, mine, rounds, ent=False)[0]

    def _values(self, critic: nn.Module, packed: PackedBatch, rows: list[int]) -> Tensor:
        if self.options.share_prompts:
            return token_values_shared(critic, packed, rows)
        return token_values(critic, packed, rows)

    def _values_forward(
        self,
        critic: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        *,
        keep: bool,
    ) -> tuple[Tensor, list[Tensor]]:
        """The critic's values ``[B, T]`` of the whole batch (detached, on CPU, summed over
        ranks as the log-probs are) and, with ``keep``, each round's output with its graph
        for the backward pass (else computed without grad)."""
        full = torch.zeros(packed.size, packed.width, device=self.device)
        graphs: list[Tensor] = []
        with torch.set_grad_enabled(keep):
            for i in range(rounds):
                rows = mine[i] if i < len(mine) else None
                v = self._values(critic, packed, rows or [0])
                if keep:
                    graphs.append(v)
                if rows:
                    full[torch.tensor(rows, device=self.device), : v.shape[1]] = v.detach()
        if self.world_size > 1:
            dist.all_reduce(full)
        return full.cpu(), graphs

    def compute_values(self, groups: list[Any]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens, without grad (the critic is
        built first if it is not yet)."""
        critic = self._critic_ready()
        packed = pack(groups)
        mine, rounds, _ = self._plan(packed)
        values, _ = self._values_forward(critic, packed, mine, rounds, keep=False)
        return values

    def compute_logprobs(self, groups: list[Any]) -> tuple[Tensor, Tensor]:
        """Log-probs and entropies ``[B, T]`` of the response tokens, without grad; with
        several adapters each group's rows under the adapter it names."""
        model = self._ready()
        packed = pack(groups)
        split = by_adapter(groups, self.adapters, "fsdp2")
        if len(self.adapters) <= 1:
            mine, rounds, _ = self._plan(packed)
            return self._forward_all(model, packed, mine, rounds, ent=True)
        lp_full = torch.zeros(packed.size, packed.width)
        ent_full = torch.zeros(packed.size, packed.width)
        starts = [0]
        for group in groups:
            starts.append(starts[-1] + len(group.samples))
        for name, indices in split.items():
            self._activate(name)
            part = pack([groups[i] for i in indices])
            mine, rounds, _ = self._plan(part)
            lp, ent = self._forward_all(model, part, mine, rounds, ent=True)
            rows = torch.tensor([r for i in indices for r in range(starts[i], starts[i + 1])])
            lp_full[rows, : part.width] = lp
            ent_full[rows, : part.width] = ent
        return lp_full, ent_full

    # --- train ----------------------------------------------------------------------------

    def train_step(self, groups: list[Any], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One update on ``groups`` (see the package README for the exact sequence). With
        several adapters, one update per adapter the groups name, in order of first
        appearance, on its groups alone (that adapter active, its optimizer and schedule);
        an adapter no group names is left untouched. Its metrics are then each adapter's as
        ``<name>/<key>``, and the totals
        (:data:`~miles_trainer_common.controller.TOTALS`) unprefixed."""
        model = self._ready()
        needs = check_algorithm(algorithm, SUPPORTED_NEEDS, "fsdp2", len(self.adapters))
        metrics = train_by_adapter(
            groups,
            self.adapters,
            "fsdp2",
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
        router = self._routers.get(id(model))
        if router is not None:
            if packed.routed_experts is None:
                raise ValueError(
                    f"rollout.routing {self.routing!r}: the samples carry no routing record "
                    "of the engine (routed_experts); never trained without it"
                )
            router.reset()
        batch = make_token_batch(packed)
        mine, rounds, n_micro = self._plan(packed)

        # The current policy's log-probs: the behaviour policy when it is recomputed, and
        # the point at which the whole batch's loss gradient is taken. With keep_activations
        # they come from the forward whose graph the backward runs through (an update taken
        # right after its own forward: the same values a no-grad pass would give).
        optimizer.zero_grad(set_to_none=True)
        graphs: list[tuple[list[int] | None, Tensor, Tensor | None]] | None = None
        if self.options.keep_activations:
            lp, ent, graphs = self._forward_with_grad(model, packed, mine, rounds)
        else:
            lp, ent = self._forward_all(model, packed, mine, rounds, ent=True)
        if self.true_on_policy:
            check_on_policy(lp, packed.rollout_logprobs, packed.response_mask, packed.group_index)
        if "old_logprobs" in needs:
            batch.old_logprobs = lp.clone()
        if "ref_logprobs" in needs:
            batch.ref_logprobs = self._ref_logprobs(model, packed, mine, rounds)
        # The critic's values before its update: the baseline of GAE and the centre of the
        # value clipping; with keep_activations their graphs serve the critic's backward.
        values: Tensor | None = None
        value_graphs: list[Tensor] = []
        if critic is not None:
            assert self.critic_optimizer is not None
            self.critic_optimizer.zero_grad(set_to_none=True)
            values, value_graphs = self._values_forward(
                critic, packed, mine, rounds, keep=self.options.keep_activations
            )
            batch.values = values.clone()
        algorithm.compute_advantages(batch)

        # The loss of the whole batch, as a function of its log-probs and entropies: its
        # gradient with respect to them is then pushed through the model one micro-batch at a
        # time, so any aggregation (token mean, sequence mean, constant, sequence ratios) is
        # exactly that of one big batch, whatever the split.
        # The critic's values enter the same way, as a leaf whose gradient is then pushed
        # through the critic.
        lp_leaf = lp.clone().requires_grad_(True)
        ent_leaf = ent.clone().requires_grad_(True)
        leaves = [lp_leaf, ent_leaf]
        if values is not None:
            v_leaf = values.clone().requires_grad_(True)
            leaves.append(v_leaf)
            loss, algo_metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf, values=v_leaf)
        else:
            loss, algo_metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf)
        grads_out: list[Tensor | None] = [None] * len(leaves)
        if loss.requires_grad:
            grads_out = list(torch.autograd.grad(loss, leaves, allow_unused=True))
        g_lp, g_ent = grads_out[0], grads_out[1]
        if g_lp is None:
            g_lp = torch.zeros_like(lp)

        from torch.distributed.fsdp import FSDPModule

        assert isinstance(model, FSDPModule)
        for i in range(rounds):
            rows = mine[i] if i < len(mine) else None
            # Reduce-scatter once, after the last micro-batch; earlier ones accumulate locally.
            model.set_requires_gradient_sync(i == rounds - 1)
            run = rows or [0]
            if graphs is not None:
                # This round's kept forward; popped so its activations go with its backward.
                _, lp_mb, ent_mb = graphs.pop(0)
            else:
                lp_mb, ent_mb = self._logprobs(model, packed, run, entropy=g_ent is not None)
            width = lp_mb.shape[1]
            index = torch.tensor(run)
            scale = 1.0 if rows else 0.0
            outputs = [lp_mb]
            grads = [(g_lp[index, :width] * scale).to(self.device)]
            if g_ent is not None and ent_mb is not None:
                outputs.append(ent_mb)
                grads.append((g_ent[index, :width] * scale).to(self.device))
            torch.autograd.backward(outputs, grads)
        model.set_requires_gradient_sync(True)
        grad_norm, lr, skipped = _update(optimizer, scheduler, self.options.max_grad_norm)

        critic_metrics: dict[str, float] = {}
        if critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            g_v = grads_out[2] if grads_out[2] is not None else torch.zeros_like(lp)
            self._critic_backward(critic, packed, mine, rounds, value_graphs, g_v)
            c_norm, c_lr, c_skipped = _update(
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
        if router is not None:
            reduce = dist.all_reduce if self.world_size > 1 else None
            metrics.update(router.metrics(reduce))
            # what the routing record adds to the batch, per token forwarded
            metrics["routing/bytes_per_token"] = packed.routing_bytes / max(1, tokens)
        return metrics

    def _critic_backward(
        self,
        critic: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        graphs: list[Tensor],
        g_v: Tensor,
    ) -> None:
        """Push the loss's gradient with respect to the values through the critic, one
        micro-batch at a time, as the policy's is (kept graphs, or a forward with grad)."""
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(critic, FSDPModule)
        for i in range(rounds):
            rows = mine[i] if i < len(mine) else None
            critic.set_requires_gradient_sync(i == rounds - 1)
            run = rows or [0]
            v_mb = graphs.pop(0) if graphs else self._values(critic, packed, run)
            index = torch.tensor(run)
            scale = 1.0 if rows else 0.0
            grad = (g_v[index, : v_mb.shape[1]] * scale).to(self.device)
            torch.autograd.backward([v_mb], [grad])
        critic.set_requires_gradient_sync(True)

    # --- weights --------------------------------------------------------------------------

    def _stream(
        self, pairs: Iterator[tuple[str, Tensor]], device: str | None
    ) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) of each (name, state-dict value or full tensor), in the
        options' ``export_dtype`` and on ``device``."""
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.options.export_dtype or "")
        for name, value in pairs:
            full = _full(value).detach()
            if full.data_ptr() == _local(value).data_ptr():
                # One rank: the "gathered" tensor may be the parameter itself; a consumer that
                # keeps it must not see it change at the next step.
                full = full.clone()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            if device is not None:
                full = full.to(device)
            yield name, full

    def _adapter(self, name: str | None) -> Any:
        return pick_adapter(self.adapters, name, "fsdp2")

    def export_tensors(
        self, device: str | None = None, adapter: str | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Collective: every (HF state-dict name, full tensor), one at a time; with adapters,
        the tensors of the adapter named ``adapter`` (``None``: the only one) alone, in
        PEFT's names: what the engines load."""
        model = self._ready()
        if self.adapters:
            yield from self._stream(self._adapter(adapter).named_weights(model), device)
            return
        if adapter is not None:
            self._adapter(adapter)  # raises: there is no adapter
        yield from self._stream(iter(model.state_dict().items()), device)

    def export_model(
        self, device: str | None = None, adapter: str | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Collective: the whole policy as plain HF weights, the adapter named ``adapter``
        (``None``: the only one) merged in, no other adapter (without adapters,
        :meth:`export_tensors`)."""
        model = self._ready()
        if not self.adapters:
            yield from self.export_tensors(device, adapter)
            return
        yield from self._stream(self._adapter(adapter).merged_weights(model, _full), device)

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """Collective: the adapter named ``adapter`` (``None``: the only one) in PEFT's format
        under ``path``, written by rank 0."""
        model = self._ready()
        if not self.adapters:
            raise RuntimeError("save_adapter: this fsdp2 trainer has no adapter")
        impl = self._adapter(adapter)
        weights = list(self._stream(impl.named_weights(model), "cpu"))
        if self.rank == 0:
            impl.save_pretrained(weights, path)
        dist.barrier()

    def fingerprint(self) -> dict[str, str]:
        """Collective: sha256 of the full weights (``weights``) and of the full state of every
        optimizer and schedule (``optimizer``); with adapters, of each adapter's tensors
        (``adapter/<name>``) and of its optimizer and schedule (``optimizer/<name>``)."""
        model = self._ready()
        weights, optim_hex = _hash_state(
            model,
            list(self.optimizers.values()),
            list(self.schedulers.values()),
            f"step={self.step}".encode(),
        )
        out = {"weights": weights, "optimizer": optim_hex}
        for adapter in self.adapters:
            h = hashlib.sha256()
            for name, value in adapter.named_weights(model, _full):
                h.update(name.encode())
                hash_tensor(h, value)
            out[f"adapter/{adapter.name}"] = h.hexdigest()
            out[f"optimizer/{adapter.name}"] = _hash_optim(
                adapter.parameters(model),
                [self.optimizers[adapter.name]],
                [self.schedulers[adapter.name]],
            )
        if self.critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            out["critic"], out["critic_optimizer"] = _hash_state(
                self.critic, [self.critic_optimizer], [self.critic_scheduler]
            )
        return out

    # --- checkpoints ----------------------------------------------------------------------

    def save(self, path: str, extra: dict[str, Any], weight_version: int) -> None:
        """Collective: sharded model and optimizers (torch.distributed.checkpoint), per-rank
        RNG states, and on rank 0 the schedules, step, weight version and ``extra``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        model = self._ready()
        os.makedirs(path, exist_ok=True)
        # Before its first step AdamW has no state; get_state_dict fills it by a zero step,
        # which would shift Adam's step count: remember to drop it again.
        fresh = {key: not o.state for key, o in self.optimizers.items()}
        optimizers = list(self.optimizers.values())
        model_sd, optim_sd = get_state_dict(model, optimizers, options=self._policy_sd())
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        critic_meta: dict[str, Any] | None = None
        if self.critic is not None:
            assert self.critic_optimizer is not None and self.critic_scheduler is not None
            critic_fresh = not self.critic_optimizer.state
            state["critic"], state["critic_optimizer"] = get_state_dict(
                self.critic, self.critic_optimizer
            )
            critic_meta = {
                "scheduler": self.critic_scheduler.state_dict(),
                "optimizer_fresh": critic_fresh,
            }
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        with warnings.catch_warnings():
            # A checkpoint saved again to the same folder replaces the old one, by choice.
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp_save(
                state,
                storage_writer=FileSystemWriter(os.path.join(path, "sharded"), overwrite=True),
            )
        for key, optimizer in self.optimizers.items():
            if fresh[key]:
                optimizer.state.clear()
        if critic_meta is not None and critic_meta["optimizer_fresh"]:
            assert self.critic_optimizer is not None
            self.critic_optimizer.state.clear()
        torch.save(rng_state(self.device), os.path.join(path, f"rng_rank{self.rank}.pt"))
        if self.rank == 0:
            torch.save(
                {
                    "step": self.step,
                    "weight_version": weight_version,
                    # by adapter name ("" for the whole model)
                    "schedulers": {k: s.state_dict() for k, s in self.schedulers.items()},
                    "optimizers_fresh": fresh,
                    "critic": critic_meta,
                    "extra": extra,
                    "world_size": self.world_size,
                    "model_path": self.model_path,
                    "options": self.options.model_dump(mode="json"),
                    "adapters": self._adapter_configs(),
                },
                os.path.join(path, "trainer.pt"),
            )
        dist.barrier()

    def _policy_sd(self) -> Any:
        """The policy's state-dict options: with adapters, their trainable weights alone (the
        frozen base is the checkpoint at ``model_path``, read again by :meth:`setup`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if not self.adapters:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def _adapter_configs(self) -> dict[str, dict[str, Any]]:
        """Each adapter's ``engine_config`` by its name."""
        return {a.name: a.engine_config() for a in self.adapters}

    def load(self, path: str) -> tuple[dict[str, Any], int]:
        """Collective: restore what :meth:`save` wrote; returns ``(extra, weight_version)``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        model = self._ready()
        trainer_file = os.path.join(path, "trainer.pt")
        if not os.path.exists(trainer_file):
            raise FileNotFoundError(f"{path} holds no fsdp2 checkpoint (no trainer.pt)")
        # Tensors and plain values only (``extra`` included): resuming a checkpoint someone
        # else wrote must not run their code.
        meta = load_checkpoint_file(trainer_file)
        if "adapters" in meta:
            saved_adapters = meta["adapters"]
            schedulers, fresh = meta["schedulers"], meta["optimizers_fresh"]
        else:  # written before a trainer held several adapters
            old = meta.get("adapter")
            saved_adapters = {} if old is None else {"default": old}
            schedulers = {"": meta["scheduler"]}
            fresh = {"": meta.get("optimizer_fresh", False)}
        if saved_adapters != self._adapter_configs():
            raise ValueError(
                f"{path} was saved by an fsdp2 trainer with adapters {saved_adapters or 'none'}, "
                f"and this one has {self._adapter_configs() or 'none'}: a checkpoint resumes "
                "only with the adapters (their served_name and adapter options) it was saved "
                "with"
            )
        critic_meta = meta.get("critic")
        if critic_meta is None:
            # Saved before any critic existed: the next step that needs one builds it fresh,
            # as the saved trainer would have.
            self.critic = self.critic_optimizer = self.critic_scheduler = None
        elif self.critic is None:
            self._build_critic()
        optimizers = list(self.optimizers.values())
        model_sd, optim_sd = get_state_dict(model, optimizers, options=self._policy_sd())
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        if critic_meta is not None:
            assert self.critic is not None and self.critic_optimizer is not None
            state["critic"], state["critic_optimizer"] = get_state_dict(
                self.critic, self.critic_optimizer
            )
        sharded = os.path.join(path, "sharded")
        check_sharded_checkpoint(sharded)  # DCP unpickles its metadata: allowed types only
        dcp_load(state, checkpoint_id=sharded, planner=plain_load_planner())
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._policy_sd(),
        )
        for key, scheduler in self.schedulers.items():
            scheduler.load_state_dict(schedulers[key])
            if fresh[key]:
                self.optimizers[key].state.clear()
        if critic_meta is not None:
            assert self.critic is not None and self.critic_optimizer is not None
            assert self.critic_scheduler is not None
            set_state_dict(
                self.critic,
                self.critic_optimizer,
                model_state_dict=state["critic"],
                optim_state_dict=state["critic_optimizer"],
            )
            self.critic_scheduler.load_state_dict(critic_meta["scheduler"])
            if critic_meta.get("optimizer_fresh"):
                self.critic_optimizer.state.clear()
        self.step = int(meta["step"])
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):
            set_rng_state(load_checkpoint_file(rng_file), self.device)
        dist.barrier()
        return dict(meta["extra"]), int(meta["weight_version"])

    # --- placement ------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free gradients; on a GPU move parameters and optimizer state (the policy's, every
        adapter's, the reference model's and the critic's) to the CPU."""
        self._ready()
        models = [self.model, self.ref_model, self.critic]
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
        shared.sleep(optimizers, models, self.device)
        self.asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if self.model is None:
            raise RuntimeError("the fsdp2 trainer is not set up: call setup(model_path) first")
        if not self.asleep:
            return
        models = [self.model, self.ref_model, self.critic]
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
        shared.wake(optimizers, models, self.device)
        self.asleep = False
