"""Where a Megatron rank sits (its tensor-, pipeline- and data-parallel groups) and one
micro-batch through the pipeline: a round is one micro-batch of this replica (or a padding
pass); every stage runs it, the first from token ids, the others from the previous stage's
output, received over gloo or NCCL; the last stage computes the log-probs (or a critic's
values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from miles_trainer_common.batch import PackedBatch
from miles_trainer_common.layout import shared_layout
from miles_trainer_common.logprobs import logprobs_at
from miles_trainer_common.worker import Round, backward_outputs, join_group
from torch import Tensor, nn

from miles_backend_megatron.model import causal_mask, head, hidden_size, hidden_states, values_at
from miles_backend_megatron.options import MegatronOptions


@dataclass
class Layout:
    """This rank's place: ranks are ordered tensor fastest, then data, then pipeline."""

    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    prev_rank: int
    next_rank: int
    last_rank: int
    device: torch.device

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_owner(self, stage: int) -> int:
        """The first rank of pipeline stage ``stage``."""
        return stage * self.tp * self.dp

    @classmethod
    def join(
        cls, options: MegatronOptions, store_path: str | None, rank: int, device: torch.device
    ) -> Layout:
        """The default process group and Megatron's tensor/pipeline/data-parallel groups."""
        from megatron.core import parallel_state as ps

        join_group(device, store_path, rank, options.world_size, options.timeout_s)
        tp, pp = options.tensor_parallel, options.pipeline_parallel
        if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size() != tp
            or ps.get_pipeline_model_parallel_world_size() != pp
        ):
            ps.destroy_model_parallel()
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                distributed_timeout_minutes=max(1, int(options.timeout_s // 60)),
            )
        layout = cls(
            rank=rank,
            tp=tp,
            pp=pp,
            dp=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            prev_rank=ps.get_pipeline_model_parallel_prev_rank(),
            next_rank=ps.get_pipeline_model_parallel_next_rank(),
            last_rank=ps.get_pipeline_model_parallel_last_rank(),
            device=device,
        )
        # The export relies on this order to find each stage's first rank.
        expected = layout.tp_rank + tp * (layout.dp_rank + layout.dp * layout.pp_rank)
        if expected != rank:
            raise RuntimeError(f"unexpected Megatron rank order: rank {rank} is {expected}")
        return layout


def forward_round(
    layout: Layout,
    model: nn.Module,
    packed: PackedBatch,
    rows: list[int],
    *,
    entropy: bool,
    shared: bool,
    invariant: bool,
    value_head: nn.Module | None = None,
) -> Round:
    """This stage's part of one micro-batch: on the last stage ``out`` the log-probs, or with
    a ``value_head`` (a critic's last stage) the values at the same positions; on the others
    ``out`` is ``None``. ``state`` keeps the stage's input and output for the backward. Runs
    with or without grad as the caller's context says. With ``shared``, a group's prompt is
    one row followed by its responses (:func:`miles_trainer_common.layout.shared_layout`);
    else one right-padded row per sample under a causal mask."""
    device = layout.device
    if shared:
        lay = shared_layout(packed, rows)
        ids, position = lay.ids.to(device), lay.position.to(device)
        mask = (~lay.sees[:, None]).to(device)  # Megatron: True = not attended
        unit, pos, target, valid, first = lay.unit, lay.pos, lay.target, lay.valid, lay.first
    else:
        index = torch.tensor(rows, dtype=torch.long)
        prompt = packed.prompt_lens[index]
        response = packed.response_lens[index]
        length = int((prompt + response).max())
        ids, position = packed.input_ids[index, :length].to(device), None
        mask = causal_mask(length, device)
        first = int(prompt.min()) - 1
        steps = torch.arange(max(1, int(response.max())))[None, :]
        valid = steps < response[:, None]
        pos = (prompt[:, None] - 1 + steps).clamp(max=length - 1)
        target = ids.cpu().gather(1, (pos + 1).clamp(max=length - 1))
        unit = torch.arange(len(rows))
    width = max(1, int(packed.response_lens[torch.tensor(rows)].max()) if layout.last_stage else 0)
    x = None
    if not layout.first_stage:
        size = hidden_size(model)  # the policy's, or a critic's own
        x = torch.empty(ids.shape[1], ids.shape[0], size, device=device)
        dist.recv(x, src=layout.prev_rank)
        x.requires_grad_(torch.is_grad_enabled())
    hidden = hidden_states(model, ids, mask, input_tensor=x, position=position)
    if not layout.last_stage:
        dist.send(hidden.detach().contiguous(), dst=layout.next_rank)
        return Round(None, None, width, {"input": x, "output": hidden})
    at = (unit.to(device), (pos - first).to(device))
    if value_head is not None:
        values = values_at(value_head, hidden[first:], *at, valid.to(device))
        return Round(values, None, width, {"input": x})
    logits = head(model, hidden[first:], invariant=invariant)
    # drawn with top-p or top-k: the log-probs of the truncated distribution
    truncation = None if packed.truncation is None else packed.truncation.rows(rows)
    lp, ent = logprobs_at(
        logits, *at, target.to(device), valid.to(device), entropy=entropy, truncation=truncation
    )
    return Round(lp, ent, width, {"input": x})


def backward_round(layout: Layout, round_: Round, g_out: Tensor, g_ent: Tensor | None) -> None:
    """Backpropagate one round through this stage: from the loss's gradients with respect to
    the log-probs (and entropies), or a critic's values, on the last stage, from the next
    stage's gradient of this stage's output on the others; hand the input's gradient to the
    previous stage."""
    if layout.last_stage:
        backward_outputs(round_, g_out, g_ent, layout.device)
    else:
        out = round_.state["output"]
        grad = torch.empty_like(out)
        dist.recv(grad, src=layout.next_rank)
        if out.requires_grad:
            # (a first stage with nothing to train, the base frozen and no LoRA branch there,
            # has no graph: the gradient stops here)
            torch.autograd.backward([out], [grad])
    if not layout.first_stage:
        x = round_.state["input"]
        dist.send(x.grad if x.grad is not None else torch.zeros_like(x), dst=layout.prev_rank)


def gather(layout: Layout, lp: Tensor, ent: Tensor, entropy: bool) -> None:
    """The last stage's outputs to every stage, then each replica's rows to all."""
    if layout.pp > 1:
        dist.broadcast(lp, src=layout.last_rank, group=layout.pp_group)
        if entropy:
            dist.broadcast(ent, src=layout.last_rank, group=layout.pp_group)
    if layout.dp > 1:
        dist.all_reduce(lp, group=layout.dp_group)
        if entropy:
            dist.all_reduce(ent, group=layout.dp_group)
