"""The Megatron rank's part of a checkpoint: every rank's model part (with adapters, their
LoRA tensors alone: the frozen base is re-read from ``model_path``), the state of every
optimizer (by adapter name; "" for the whole model), RNG states and, once a critic exists, its
part of the critic and the critic's optimizer state, in the rank's own file; and what rank 0
adds to ``trainer.pt`` (the rest of it is
:meth:`miles_trainer_common.worker.TrainerRank.save`'s).

A checkpoint resumes at another tensor, pipeline or data-parallel layout too: each rank file
records how its tensors are split and which layers it holds, and a rank of the new layout
rebuilds its own part from the saved ones (:mod:`miles_backend_megatron.reshard`), except with
Megatron's distributed optimizer, whose checkpoint resumes at its own layout only."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from miles_trainer_common.state import load_checkpoint_file, rng_state, set_rng_state
from torch import Tensor, nn

from miles_backend_megatron import lora, reshard

if TYPE_CHECKING:
    from miles_backend_megatron.worker import RankWorker


def _state(model: nn.Module, *, lora_only: bool = False) -> dict[str, Tensor]:
    """``model``'s tensors a checkpoint holds (Megatron lists ``_extra_state`` entries, None
    without Transformer Engine: left out); ``lora_only``: its LoRA tensors alone."""
    return {
        k: v
        for k, v in model.state_dict().items()
        if isinstance(v, Tensor) and (not lora_only or lora.lora_split(k) is not None)
    }


def _tensors(model: nn.Module, *, lora_only: bool = False) -> dict[str, Tensor]:
    """:func:`_state` on the CPU."""
    return {k: v.detach().cpu() for k, v in _state(model, lora_only=lora_only).items()}


def _layout(worker: RankWorker) -> dict[str, int]:
    o = worker.options
    return {
        "tensor_parallel": o.tensor_parallel,
        "pipeline_parallel": o.pipeline_parallel,
        "data_parallel": o.data_parallel,
    }


def save(worker: RankWorker, path: str) -> dict[str, Any]:
    """Collective: write the rank's file under ``path``; what rank 0 adds to ``trainer.pt``."""
    assert worker.model is not None
    own: dict[str, Any] = {
        "model": _tensors(worker.model, lora_only=bool(worker.adapters)),
        "optimizers": {k: o.state_dict() for k, o in worker.optimizers.items()},
        "rng": rng_state(worker.device),
    }
    critic_meta: dict[str, Any] | None = None
    if worker.critic is not None:
        assert worker.critic_optimizer is not None and worker.critic_scheduler is not None
        own["critic"] = _tensors(worker.critic)
        own["critic_optimizer"] = worker.critic_optimizer.state_dict()
        critic_meta = {"scheduler": worker.critic_scheduler.state_dict()}
    own.update(reshard.rank_fields(worker, list(own["model"])))
    torch.save(own, os.path.join(path, f"rank{worker.rank}.pt"))
    # "reshardable": the rank files record what a load at another layout needs
    return {"critic": critic_meta, "layout": _layout(worker), "reshardable": True}


def check(worker: RankWorker, path: str, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint saved with another optimizer, or at another layout when it cannot
    be resharded: with Megatron's distributed optimizer, or written before the rank files
    recorded how their tensors are split."""
    saved_sharded = bool(meta.get("options", {}).get("distributed_optimizer", False))
    if saved_sharded != worker.options.distributed_optimizer:
        raise ValueError(
            f"the checkpoint at {path} was saved with backend.distributed_optimizer="
            f"{str(saved_sharded).lower()}; this trainer has "
            f"{str(worker.options.distributed_optimizer).lower()} (its optimizer state is "
            "laid out for that one: resume with the same)"
        )
    if meta["layout"] == _layout(worker):
        return
    if saved_sharded:
        raise ValueError(
            f"the checkpoint at {path} was saved with layout {meta['layout']} and "
            f"backend.distributed_optimizer=true; this trainer has {_layout(worker)}: the "
            "distributed optimizer's state is sharded in Megatron's own buffer order, so its "
            "checkpoint resumes only with the same tensor_parallel, pipeline_parallel and "
            "data_parallel"
        )
    if not meta.get("reshardable"):
        raise ValueError(
            f"the checkpoint at {path} was saved with layout {meta['layout']} by a version "
            "that did not record how its tensors are split; this trainer has "
            f"{_layout(worker)} (resume with the same tensor/pipeline/data parallel)"
        )


def _load_tensors(
    worker: RankWorker,
    model: nn.Module,
    tensors: dict[str, Tensor],
    path: str,
    *,
    lora_only: bool = False,
) -> None:
    with torch.no_grad():
        result = model.load_state_dict(
            {k: v.to(worker.device) for k, v in tensors.items()}, strict=False
        )
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if lora_only:
        missing = [k for k in missing if lora.lora_split(k) is not None]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint at {path} does not fit this model: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )


def load(worker: RankWorker, path: str, meta: dict[str, Any]) -> None:
    """Collective: restore what :func:`save` wrote (``meta``: ``trainer.pt``; the critic is
    built already when the checkpoint holds one)."""
    assert worker.model is not None
    if meta["layout"] == _layout(worker):
        own = load_checkpoint_file(os.path.join(path, f"rank{worker.rank}.pt"))
    else:  # another layout (check allowed it): this rank's part rebuilt from the saved ones
        wanted = _state(worker.model, lora_only=bool(worker.adapters))
        own = reshard.rank_state(worker, path, meta, {k: v.shape for k, v in wanted.items()})
    if "optimizers" in own:
        optimizers, schedulers = own["optimizers"], meta["schedulers"]
    else:  # written before a trainer held several adapters: one optimizer
        (key,) = worker.optimizers
        optimizers, schedulers = {key: own["optimizer"]}, {key: meta["scheduler"]}
    _load_tensors(worker, worker.model, own["model"], path, lora_only=bool(worker.adapters))
    for key, optimizer in worker.optimizers.items():
        optimizer.load_state_dict(optimizers[key])
        worker.schedulers[key].load_state_dict(schedulers[key])
    critic_meta = meta.get("critic")
    if critic_meta is not None:
        assert worker.critic is not None and worker.critic_optimizer is not None
        assert worker.critic_scheduler is not None
        _load_tensors(worker, worker.critic, own["critic"], path)
        worker.critic_optimizer.load_state_dict(own["critic_optimizer"])
        worker.critic_scheduler.load_state_dict(critic_meta["scheduler"])
    set_rng_state(own["rng"], worker.device)
