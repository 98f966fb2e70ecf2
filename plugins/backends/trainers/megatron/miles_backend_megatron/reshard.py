"""Resuming a Megatron checkpoint at another layout (tensor, pipeline or data parallel): each
rank of the new layout rebuilds, from the saved ranks' files, the file it would have written
itself (:func:`rank_state`), then loads it as at the same layout.

Each saved rank file records what this needs, so that a load never guesses
(:func:`rank_fields`): ``splits``, how each of its tensors is split over the tensor-parallel
ranks (:func:`miles_backend_megatron.bridge.split_of`: ``column`` along the rows, ``row`` along
the columns, ``gate_up`` the gate and the up halves each along the rows, or ``replicated``);
``layers``, the global decoder layers its pipeline stage holds; ``optimizer_params``, each
optimizer's parameters by name, in the optimizer's order (its state is keyed by that
position). ``trainer.pt`` holds the layout.

A saved stage is merged from its first data-parallel replica's ranks (the replicas hold the
same weights and optimizer state), its local layer numbers made global; the new rank's part of
each tensor, and of Adam's ``exp_avg`` and ``exp_avg_sq`` (split as their parameter; the
``step`` count as it is), is cut from the whole with the same split. A new rank reads only the
saved stages that hold its tensors, memory-mapped, and holds their whole tensors while it cuts
its part. With tied embeddings the last stage of a pipeline keeps its own copy of the
embedding (``output_layer.weight``; one stage has none): a new layout's copy is taken from the
embedding (equal to it in values and optimizer state: the backend sums their gradients), a
saved copy the new layout does not have is left out. The RNG states are per rank: new rank
``r`` restores saved rank ``r % saved_world_size``'s.

Megatron's distributed optimizer keeps its state in its own buffers' order, sharded over the
data-parallel replicas: its checkpoints resume only at the layout they were saved with
(:func:`miles_backend_megatron.checkpoint.check`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from miles_trainer_common.state import load_checkpoint_file
from torch import Tensor, nn

from miles_backend_megatron.bridge import shard, split_of, stage_layers, unshard
from miles_backend_megatron.shape import ModelShape

if TYPE_CHECKING:
    from miles_backend_megatron.worker import RankWorker

#: a decoder layer's number in a parameter's name (the policy's, or a critic body's)
_LAYER = re.compile(r"((?:^|\.)decoder\.layers\.)(\d+)(\.)")
#: with tied embeddings, the head's copy and the embedding it copies
_TIED_COPY, _EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def renumber(name: str, shift: int) -> str:
    """``name`` with its decoder layer's number moved by ``shift`` (local <-> global)."""
    return _LAYER.sub(lambda m: f"{m[1]}{int(m[2]) + shift}{m[3]}", name, count=1)


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names (in ``model``) of ``optimizer``'s parameters, in its order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _shape(worker: RankWorker) -> ModelShape:
    assert worker.shape is not None, "setup() first"
    return worker.shape


def rank_fields(worker: RankWorker, model_keys: list[str]) -> dict[str, Any]:
    """What a rank file records for a load at another layout (``model_keys``: the policy's
    tensors the file holds). With Megatron's distributed optimizer, whose state is keyed by
    its shards, the optimizers' parameter names are left out (such a checkpoint resumes at
    its own layout only)."""
    assert worker.model is not None
    layers = stage_layers(_shape(worker), worker.layout.pp_rank, worker.layout.pp)
    out: dict[str, Any] = {
        "layers": [layers.start, layers.stop],
        "splits": {k: split_of(k) for k in model_keys},
    }
    if worker.sharded is None:
        out["optimizer_params"] = {
            key: param_names(worker.model, o) for key, o in worker.optimizers.items()
        }
    if worker.critic is not None:
        assert worker.critic_optimizer is not None
        critic_keys = [k for k, v in worker.critic.state_dict().items() if isinstance(v, Tensor)]
        out["critic_splits"] = {k: split_of(k) for k in critic_keys}
        out["critic_optimizer_params"] = param_names(worker.critic, worker.critic_optimizer)
    return out


class _Cut:
    """A new rank's place: the global name of a local one, and its part of a whole tensor."""

    def __init__(self, shift: int, tp_rank: int, tp: int) -> None:
        self.shift, self.tp_rank, self.tp = shift, tp_rank, tp

    def global_name(self, name: str) -> str:
        return renumber(name, self.shift)

    def __call__(self, value: Any, kind: str) -> Any:
        """This rank's part of ``value`` (a tensor split as ``kind``; a 0-dim tensor, such as
        Adam's step count, or a plain value: as it is)."""
        if not isinstance(value, Tensor):
            return value
        return shard(value, kind, self.tp_rank, self.tp) if value.dim() > 0 else value.clone()


@dataclass
class _Whole:
    """One module's (the policy's, or the critic's) whole tensors over the saved stages read,
    by global name, and each optimizer's state by parameter (global name) and its groups."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    splits: dict[str, str] = field(default_factory=dict)
    states: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @staticmethod
    def lookup(name: str, table: dict[str, Any]) -> tuple[str, Any]:
        """(the global name it is found under, the entry of ``table``, None when absent) for
        ``name``: a tied head's copy absent from the saved stages is the embedding's."""
        if name not in table and name.endswith(_TIED_COPY):
            embedding = name[: -len(_TIED_COPY)] + _EMBEDDING
            if embedding in table:
                return embedding, table[embedding]
        return name, table.get(name)

    def merge(self, files: list[dict[str, Any]], critic: bool) -> None:
        """Add one saved stage (its tensor-parallel ranks' ``files``, in rank order)."""
        parts = [_part(f, critic) for f in files]
        _, splits, optimizers, names = parts[0]
        shift = int(files[0]["layers"][0])
        for name, kind in splits.items():
            self.tensors[renumber(name, shift)] = unshard([p[0][name] for p in parts], kind)
            self.splits[renumber(name, shift)] = kind
        for key, order in names.items():
            self.groups.setdefault(key, optimizers[key]["param_groups"])
            states = self.states.setdefault(key, {})
            for i, name in enumerate(order):
                each = [p[2][key]["state"].get(i) for p in parts]
                if each[0] is None:
                    continue  # not stepped yet
                states[renumber(name, shift)] = {
                    k: unshard([s[k] for s in each], splits[name])
                    if isinstance(v, Tensor) and v.dim() > 0
                    else v
                    for k, v in each[0].items()
                }

    def model_part(self, wanted: dict[str, torch.Size], cut: _Cut, path: str) -> dict[str, Any]:
        """A new rank's tensors (``wanted``: their local names and shapes)."""
        out: dict[str, Tensor] = {}
        for name in wanted:
            found, tensor = self.lookup(cut.global_name(name), self.tensors)
            if tensor is None:
                raise ValueError(f"the checkpoint at {path} holds no {found}")
            out[name] = part = cut(tensor, self.splits[found])
            if part.shape != wanted[name]:
                raise ValueError(
                    f"the checkpoint at {path} does not fit this model: {name} is "
                    f"{list(part.shape)} there, {list(wanted[name])} here"
                )
        return out

    def optimizer_part(
        self, key: str, names: list[str], optimizer: torch.optim.Optimizer, cut: _Cut
    ) -> dict[str, Any]:
        """The state dict of a new rank's ``optimizer`` (over its parameters ``names``): the
        saved optimizer ``key``'s settings and state, this optimizer's parameters."""
        saved, own = self.groups[key], optimizer.state_dict()["param_groups"]
        if len(saved) != len(own):
            raise ValueError(
                f"optimizer {key or 'of the policy'!r}: the checkpoint has {len(saved)} "
                f"parameter groups, this trainer {len(own)}"
            )
        groups = [{**s, "params": o["params"]} for s, o in zip(saved, own, strict=True)]
        state: dict[int, dict[str, Any]] = {}
        table = self.states.get(key, {})
        for i, name in enumerate(names):
            found, saved_state = self.lookup(cut.global_name(name), table)
            if saved_state is not None:
                state[i] = {k: cut(v, self.splits[found]) for k, v in saved_state.items()}
        return {"state": state, "param_groups": groups}


def _part(file: dict[str, Any], critic: bool) -> tuple[Any, Any, Any, Any]:
    """(tensors, splits, optimizers by key, their parameter names by key) of the policy or
    the critic in one rank file."""
    if critic:
        return (
            file["critic"],
            file["critic_splits"],
            {"": file["critic_optimizer"]},
            {"": file["critic_optimizer_params"]},
        )
    return file["model"], file["splits"], file["optimizers"], file["optimizer_params"]


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")


def _saved_stages(worker: RankWorker, path: str, saved: dict[str, int]) -> dict[int, list[Any]]:
    """The saved rank files this rank needs, by saved stage (that stage's first replica's
    tensor-parallel ranks, in order): the stages that hold a layer of this rank's stage, and
    its embedding, final norm and head (or a tied head's embedding)."""
    shape, lay = _shape(worker), worker.layout
    spp, stp, sdp = saved["pipeline_parallel"], saved["tensor_parallel"], saved["data_parallel"]
    own = set(stage_layers(shape, lay.pp_rank, lay.pp))
    need = {s for s in range(spp) if own & set(stage_layers(shape, s, spp))}
    if lay.first_stage or (lay.last_stage and shape.tied and lay.pp > 1):
        need.add(0)
    if lay.last_stage:
        need.add(spp - 1)
    return {
        s: [
            load_checkpoint_file(_rank_file(path, t + stp * sdp * s), mmap=True) for t in range(stp)
        ]
        for s in sorted(need)
    }


def rank_state(
    worker: RankWorker, path: str, meta: dict[str, Any], wanted: dict[str, torch.Size]
) -> dict[str, Any]:
    """The rank file this rank would have written at its own layout, from a checkpoint saved
    at ``meta["layout"]`` (``wanted``: the policy's tensors to restore, by local name, with
    their shapes)."""
    assert worker.model is not None
    saved, lay = meta["layout"], worker.layout
    stages = _saved_stages(worker, path, saved)
    cut = _Cut(stage_layers(_shape(worker), lay.pp_rank, lay.pp).start, lay.tp_rank, lay.tp)
    policy = _Whole()
    for files in stages.values():
        policy.merge(files, critic=False)
    own: dict[str, Any] = {
        "model": policy.model_part(wanted, cut, path),
        "optimizers": {
            key: policy.optimizer_part(key, param_names(worker.model, o), o, cut)
            for key, o in worker.optimizers.items()
        },
    }
    if meta.get("critic") is not None:
        assert worker.critic is not None and worker.critic_optimizer is not None
        critic = _Whole()
        for files in stages.values():
            critic.merge(files, critic=True)
        state = worker.critic.state_dict()
        own["critic"] = critic.model_part(
            {k: v.shape for k, v in state.items() if isinstance(v, Tensor)}, cut, path
        )
        names = param_names(worker.critic, worker.critic_optimizer)
        own["critic_optimizer"] = critic.optimizer_part("", names, worker.critic_optimizer, cut)
    world = saved["tensor_parallel"] * saved["pipeline_parallel"] * saved["data_parallel"]
    own["rng"] = load_checkpoint_file(_rank_file(path, worker.rank % world), mmap=True)["rng"]
    return own
