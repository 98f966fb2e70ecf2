"""A trainer rank's state and its persistence, the same for every backend: the options,
adapters, optimizers and LR schedules, the critic's, the device and process group; the
streamed export, the fingerprint, the checkpoint's common part and resume, sleep/wake.
:class:`miles_trainer_common.worker.TrainerRank` adds the step on top."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles_trainer_common import rank as shared
from miles_trainer_common.controller import pick_adapter
from miles_trainer_common.rank import adamw, empty_adamw, seed_everything
from miles_trainer_common.routing import RoutingReplay
from miles_trainer_common.schedule import LRSchedule

Pairs = Iterator[tuple[str, Tensor]]


def rendezvous_store(rendezvous: str | None, rank: int, world_size: int, timeout_s: float) -> Any:
    """The store ranks meet on: ``tcp://address:port`` a ``TCPStore`` that rank 0 hosts at
    that address (ranks on several nodes), any other string the path of a ``FileStore`` (one
    machine), ``None`` an in-process ``HashStore`` (one rank)."""
    if rendezvous is None:
        return dist.HashStore()  # type: ignore[attr-defined]
    if rendezvous.startswith("tcp://"):
        host, _, port = rendezvous.removeprefix("tcp://").rpartition(":")
        return dist.TCPStore(  # type: ignore[attr-defined]
            host.strip("[]"),
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
        )
    return dist.FileStore(rendezvous, world_size)  # type: ignore[attr-defined]


def join_group(
    device: torch.device, rendezvous: str | None, rank: int, world_size: int, timeout_s: float
) -> None:
    """The default process group: gloo (and NCCL for CUDA tensors) on the store at
    ``rendezvous`` (:func:`rendezvous_store`). A process that has a group already keeps it,
    if it has ``world_size`` ranks."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"this process already has a default process group of {dist.get_world_size()} "
                f"ranks; the trainer needs {world_size}"
            )
        return
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        store=rendezvous_store(rendezvous, rank, world_size, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


class RankState:
    """The state of one rank that every backend shares, and what is done with it beyond the
    step (module docstring). A subclass implements the ``NotImplementedError`` methods."""

    #: the backend's short name, in messages
    backend: ClassVar[str] = ""
    #: the algorithm inputs (``needs``) this backend computes
    supported_needs: ClassVar[frozenset[str]] = frozenset()
    #: this rank's device (set by the subclass's ``__init__``, e.g. by :meth:`_place`)
    device: torch.device

    def __init__(
        self,
        options: Any,
        rank: int,
        world_size: int,
        store_path: str | None = None,
        adapter: Any = None,
        adapters: Any = None,
        routing: str = "none",
        true_on_policy: bool = False,
    ) -> None:
        """Rank ``rank`` of ``world_size``, rendezvousing at ``store_path`` (a FileStore's
        path, or ``tcp://address:port`` of rank 0's TCPStore; ``None``: in-process, one rank:
        :func:`rendezvous_store`); the backend's :meth:`_join` places it and joins its
        process groups."""
        self.options = options
        self.rank = rank
        self.world_size = world_size
        #: the run's adapters (distinct names): only their weights train, each with its own
        #: optimizer, on the groups that name it, and are exported; empty: full fine-tuning.
        #: ``adapter=x`` is ``adapters=[x]``.
        self.adapters: list[Any] = (
            list(adapters) if adapters is not None else [adapter] if adapter is not None else []
        )
        #: the run's ``rollout.routing``: ``record`` or ``replay`` hooks the routers of the
        #: policy (and of the reference model, which replays the same record)
        self.routing = routing
        self._routers: dict[int, RoutingReplay] = {}
        #: the run's ``rollout.true_on_policy``: a step whose recomputed log-probs are not
        #: bitwise the engine's fails
        self.true_on_policy = true_on_policy
        #: a group's prompt forwarded once for all its samples
        self.shares_prompts: bool = options.share_prompts
        #: the data-parallel replicas the micro-batches are split between, and this rank's
        self.replicas, self.replica = world_size, rank
        self.model: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        # One optimizer and LR schedule per adapter, by its name (full fine-tuning: one, by
        # ""), on every rank, and the (name, parameter) pairs each trains on this rank.
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.trained: dict[str, list[tuple[str, nn.Parameter]]] = {}
        # The critic (value model) and its own optimizer and schedule: built the first time
        # an algorithm needs values (or a checkpoint holds them).
        self.critic: nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.model_path = ""
        self.step = 0
        #: the log-probs before the update of the samples trained since the last
        #: :meth:`trained_logprobs`, ``[samples, width]`` per group id (the samples'
        #: ``trainer_logprobs``), and with router hooks their expert agreement per token
        self.step_logprobs: dict[int, Tensor] = {}
        self.step_agreement: dict[int, Tensor] = {}
        self.asleep = False
        self._join(store_path)

    def trained_logprobs(self) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """The log-probs and expert agreement (NaN: no record) kept since the last call, which
        clears them (rank 0 answers them; the others, which hold the same, nothing)."""
        out = self.step_logprobs, self.step_agreement
        self.step_logprobs, self.step_agreement = {}, {}
        return out if self.rank == 0 else ({}, {})

    def _join(self, store_path: str | None) -> None:
        """Place this rank (its device) and join the process groups."""
        raise NotImplementedError

    def _place(self) -> torch.device:
        """This rank's device: its GPU (``device: cuda``), else the CPU with
        ``cpu_threads`` (by default the cores shared between the ranks)."""
        o = self.options
        if o.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device 'cuda' was asked but torch sees no CUDA device")
            device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            return device
        torch.set_num_threads(o.cpu_threads or max(1, (os.cpu_count() or 1) // self.world_size))
        return torch.device("cpu")

    def setup(self, model_path: str) -> None:
        """Build this rank's part of the policy and its optimizers."""
        raise NotImplementedError

    def _make_critic(self) -> nn.Module:
        """This rank's part of the critic (``critic.path``, default the policy's checkpoint)."""
        raise NotImplementedError

    def _switch_adapter(self, adapter: Any) -> None:
        """``adapter`` alone applies in the policy's forward."""
        raise NotImplementedError

    def _base_tensors(self, device: str | None) -> Pairs:
        """Collective: the whole policy's (HF name, full tensor) pairs."""
        raise NotImplementedError

    def _adapter_tensors(self, adapter: Any, device: str | None) -> Pairs:
        """Collective: ``adapter``'s (PEFT name, full tensor) pairs."""
        raise NotImplementedError

    def _merged_tensors(self, adapter: Any, device: str | None) -> Pairs:
        """Collective: the policy's HF weights with ``adapter`` alone merged in."""
        raise NotImplementedError

    def _weight_pairs(self) -> Pairs:
        """Collective: what the ``weights`` fingerprint hashes (the whole base weights)."""
        raise NotImplementedError

    def _adapter_pairs(self, adapter: Any) -> Pairs:
        """Collective: what the ``adapter/<name>`` fingerprint hashes."""
        raise NotImplementedError

    def _save_state(self, path: str) -> dict[str, Any]:
        """Collective: write this rank's state under ``path``; returns what rank 0 adds to
        ``trainer.pt`` (at least ``critic``: the critic's meta, or ``None``)."""
        raise NotImplementedError

    def _load_state(self, path: str, meta: dict[str, Any]) -> None:
        """Collective: restore what :meth:`_save_state` wrote (``meta``: ``trainer.pt``)."""
        raise NotImplementedError

    def _optimizer(self, params: list[nn.Parameter], lr: float | None) -> torch.optim.Optimizer:
        """The optimizer of one unit (an adapter, or the whole model): AdamW; an empty one
        on a rank that holds nothing of it, so its schedule steps with the other ranks'."""
        if params:
            return adamw(params, self.options, lr=lr)
        return empty_adamw(self.options, lr=lr)

    def _optim_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The (name, parameter) pairs the policy's optimizer state is keyed by."""
        return list(model.named_parameters())

    def _state_tensor(self, t: Tensor) -> Tensor:
        """A tensor of the state as the fingerprint hashes it (a sharded one gathered)."""
        return t

    def _combine(self, h: Any) -> str:
        """Collective: the fingerprint of a rank's own digest ``h``: one sha256 over every
        rank's, in rank order (a backend whose ``_state_tensor`` gathers: ``h`` itself)."""
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, h.hexdigest())
        return hashlib.sha256("".join(parts).encode()).hexdigest()

    def _sleep_models(self) -> list[nn.Module | None]:
        """The models :meth:`sleep` moves off the GPU (and :meth:`wake` back)."""
        return [self.model, self.ref_model, self.critic]

    def _wake_models(self) -> list[nn.Module | None]:
        return [self.model, self.ref_model, self.critic]

    def _check_saved(self, path: str, meta: dict[str, Any]) -> None:
        """Refuse a checkpoint this trainer cannot resume (beyond its adapters)."""

    def _saved_adapters(self, meta: dict[str, Any]) -> dict[str, Any]:
        return dict(meta.get("adapters", {}))

    def _schedule(
        self, optimizer: torch.optim.Optimizer, warmup: int
    ) -> torch.optim.lr_scheduler.LambdaLR:
        o = self.options
        schedule = LRSchedule(warmup, o.lr_schedule, o.decay_steps, o.min_lr_ratio)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def _build_optimizers(
        self, units: dict[str, tuple[list[tuple[str, nn.Parameter]], float | None]]
    ) -> None:
        """One optimizer and LR schedule per unit (an adapter's name, "" for the whole model)
        over its trainable (name, parameter) pairs, with its own LR (``None``: the options')."""
        self.optimizers, self.schedulers, self.trained = {}, {}, {}
        for key, (named, lr) in units.items():
            optimizer = self._optimizer([p for _, p in named], lr)
            self.optimizers[key] = optimizer
            self.schedulers[key] = self._schedule(optimizer, self.options.warmup_steps)
            self.trained[key] = [(n, p) for n, p in named if p.requires_grad]
        self.step = 0

    def _seed(self) -> None:
        seed_everything(self.options.seed)

    def _watch_routing(self, model: nn.Module, *, measure: bool = True) -> None:
        """Hook ``model``'s routers (``rollout.routing`` record or replay)."""
        if self.routing != "none":
            self._routers[id(model)] = RoutingReplay(model, self.routing, measure=measure)

    def _build_critic(self) -> nn.Module:
        """The critic, its AdamW (``critic.lr``, the policy's betas, eps, weight decay) and
        LR schedule (``critic.warmup_steps``, the policy's shape)."""
        critic = self.critic = self._make_critic()
        self.critic_optimizer = adamw(critic.parameters(), self.options, lr=self.options.critic.lr)
        self.critic_scheduler = self._schedule(
            self.critic_optimizer, self.options.critic.warmup_steps
        )
        return critic

    def _critic_ready(self) -> nn.Module:
        self._ready()
        return self.critic if self.critic is not None else self._build_critic()

    def _ready(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(
                f"the {self.backend} trainer is not set up: call setup(model_path) first"
            )
        if self.asleep:
            raise RuntimeError(f"the {self.backend} trainer is asleep: call wake() first")
        return self.model

    def _adapter(self, name: str | None) -> Any:
        return pick_adapter(self.adapters, name, self.backend)

    def _activate(self, name: str) -> None:
        """Adapter ``name`` applies in the policy's forward (with several adapters)."""
        if len(self.adapters) > 1:
            self._switch_adapter(self._adapter(name))

    def _adapter_configs(self) -> dict[str, dict[str, Any]]:
        """Each adapter's ``engine_config`` by its name."""
        return {a.name: a.engine_config() for a in self.adapters}

    def export_tensors(self, device: str | None = None, adapter: str | None = None) -> Pairs:
        """Collective: every (HF state-dict name, full tensor), one at a time; with adapters,
        the tensors of the adapter named ``adapter`` (``None``: the only one) alone, in
        PEFT's names: what the engines load."""
        self._ready()
        if self.adapters:
            return self._adapter_tensors(self._adapter(adapter), device)
        if adapter is not None:
            self._adapter(adapter)  # raises: there is no adapter
        return self._base_tensors(device)

    def export_model(self, device: str | None = None, adapter: str | None = None) -> Pairs:
        """Collective: the whole policy as plain HF weights, the adapter named ``adapter``
        (``None``: the only one) merged in, no other adapter (without adapters,
        :meth:`export_tensors`)."""
        self._ready()
        if not self.adapters:
            return self.export_tensors(device, adapter)
        return self._merged_tensors(self._adapter(adapter), device)

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """Collective: the adapter named ``adapter`` (``None``: the only one) in PEFT's format
        under ``path``, written by rank 0."""
        self._ready()
        if not self.adapters:
            raise RuntimeError(f"save_adapter: this {self.backend} trainer has no adapter")
        impl = self._adapter(adapter)
        weights = list(self.export_tensors("cpu", impl.name))
        if self.rank == 0:
            impl.save_pretrained(weights, path)
        dist.barrier()

    def fingerprint(self) -> dict[str, str]:
        """Collective: :func:`miles_trainer_common.fingerprint.fingerprint` of this rank."""
        from miles_trainer_common.fingerprint import fingerprint

        return fingerprint(self)

    def save(self, path: str, extra: dict[str, Any], weight_version: int) -> None:
        """Collective: :func:`miles_trainer_common.state.save_rank` of this rank."""
        from miles_trainer_common.state import save_rank

        save_rank(self, path, extra, weight_version)

    def load(self, path: str) -> tuple[dict[str, Any], int]:
        """Collective: :func:`miles_trainer_common.state.load_rank` of this rank."""
        from miles_trainer_common.state import load_rank

        return load_rank(self, path)

    def sleep(self) -> None:
        """Free gradients; on a GPU move parameters and optimizer state (the policy's, every
        adapter's, the reference model's and the critic's) to the CPU."""
        self._ready()
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
        shared.sleep(optimizers, self._sleep_models(), self.device)
        self.asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if self.model is None:
            raise RuntimeError(
                f"the {self.backend} trainer is not set up: call setup(model_path) first"
            )
        if not self.asleep:
            return
        optimizers = [*self.optimizers.values(), self.critic_optimizer]
        shared.wake(optimizers, self._wake_models(), self.device)
        self.asleep = False
