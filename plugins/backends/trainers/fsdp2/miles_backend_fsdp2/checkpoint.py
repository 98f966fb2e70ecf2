"""The FSDP2 rank's part of a checkpoint: the sharded model and optimizers through
``torch.distributed.checkpoint`` (DCP), per-rank RNG states, and what rank 0 adds to
``trainer.pt`` (the rest of it is :meth:`miles_trainer_common.worker.TrainerRank.save`'s).

A checkpoint resumes at any world size: DCP records every tensor's whole shape and each
saved shard's place in it, and each loading rank reads the parts of its own shards, whatever
the world size that wrote them (the weights and the optimizer state come back bitwise). The
RNG states are per rank: rank ``r`` restores saved rank ``r % saved_world_size``'s.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from miles_trainer_common.state import (
    check_sharded_checkpoint,
    load_checkpoint_file,
    plain_load_planner,
    rng_state,
    set_rng_state,
)

if TYPE_CHECKING:
    from miles_backend_fsdp2.worker import RankWorker


def _policy_options(worker: RankWorker) -> Any:
    """The policy's state-dict options: with adapters, their trainable weights alone (the
    frozen base is the checkpoint at ``model_path``, read again by ``setup``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not worker.adapters:
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _state(worker: RankWorker, with_critic: bool) -> dict[str, Any]:
    """The DCP state dict of the policy and its optimizers (and the critic's)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert worker.model is not None
    optimizers = list(worker.optimizers.values())
    model_sd, optim_sd = get_state_dict(worker.model, optimizers, options=_policy_options(worker))
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    if with_critic:
        assert worker.critic is not None and worker.critic_optimizer is not None
        state["critic"], state["critic_optimizer"] = get_state_dict(
            worker.critic, worker.critic_optimizer
        )
    return state


def save(worker: RankWorker, path: str) -> dict[str, Any]:
    """Collective: write the rank's state under ``path``; what rank 0 adds to ``trainer.pt``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    # Before its first step AdamW has no state; get_state_dict fills it by a zero step, which
    # would shift Adam's step count: remember to drop it again.
    fresh = {key: not o.state for key, o in worker.optimizers.items()}
    critic_meta: dict[str, Any] | None = None
    if worker.critic is not None:
        assert worker.critic_optimizer is not None and worker.critic_scheduler is not None
        critic_meta = {
            "scheduler": worker.critic_scheduler.state_dict(),
            "optimizer_fresh": not worker.critic_optimizer.state,
        }
    state = _state(worker, critic_meta is not None)
    with warnings.catch_warnings():
        # A checkpoint saved again to the same folder replaces the old one, by choice.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp_save(
            state, storage_writer=FileSystemWriter(os.path.join(path, "sharded"), overwrite=True)
        )
    for key, optimizer in worker.optimizers.items():
        if fresh[key]:
            optimizer.state.clear()
    if critic_meta is not None and critic_meta["optimizer_fresh"]:
        assert worker.critic_optimizer is not None
        worker.critic_optimizer.state.clear()
    torch.save(rng_state(worker.device), os.path.join(path, f"rng_rank{worker.rank}.pt"))
    return {"optimizers_fresh": fresh, "critic": critic_meta, "world_size": worker.world_size}


def load(worker: RankWorker, path: str, meta: dict[str, Any]) -> None:
    """Collective: restore what :func:`save` wrote (``meta``: ``trainer.pt``; the critic is
    built already when the checkpoint holds one)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    assert worker.model is not None
    if "adapters" in meta:
        schedulers, fresh = meta["schedulers"], meta["optimizers_fresh"]
    else:  # written before a trainer held several adapters
        schedulers = {"": meta["scheduler"]}
        fresh = {"": meta.get("optimizer_fresh", False)}
    critic_meta = meta.get("critic")
    state = _state(worker, critic_meta is not None)
    sharded = os.path.join(path, "sharded")
    check_sharded_checkpoint(sharded)  # DCP unpickles its metadata: allowed types only
    dcp_load(state, checkpoint_id=sharded, planner=plain_load_planner())
    set_state_dict(
        worker.model,
        list(worker.optimizers.values()),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_policy_options(worker),
    )
    for key, scheduler in worker.schedulers.items():
        scheduler.load_state_dict(schedulers[key])
        if fresh[key]:
            worker.optimizers[key].state.clear()
    if critic_meta is not None:
        assert worker.critic is not None and worker.critic_optimizer is not None
        assert worker.critic_scheduler is not None
        set_state_dict(
            worker.critic,
            worker.critic_optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optimizer"],
        )
        worker.critic_scheduler.load_state_dict(critic_meta["scheduler"])
        if critic_meta.get("optimizer_fresh"):
            worker.critic_optimizer.state.clear()
    rng_file = os.path.join(path, f"rng_rank{rng_source(path, meta, worker.rank)}.pt")
    if os.path.exists(rng_file):
        set_rng_state(load_checkpoint_file(rng_file), worker.device)


def rng_source(path: str, meta: dict[str, Any], rank: int) -> int:
    """The saved rank whose RNG states rank ``rank`` restores: ``rank % saved_world_size``
    (itself at the same world size; at a larger one, the ranks the saved run did not have
    take the states of the saved ranks in turn). The saved world size is ``trainer.pt``'s, or
    for a checkpoint written without it, the number of ``rng_rank*.pt`` files."""
    saved = meta.get("world_size")
    if saved is None:
        saved = sum(1 for n in os.listdir(path) if n.startswith("rng_rank") and n.endswith(".pt"))
    return rank % max(1, int(saved))
