"""Routed-expert agreement per response token: for each token of a trained sample, the fraction
of the MoE layers (of those the engine's routing record covers) whose engine top-k set is the
trainer's own top-k, at the position whose output predicts the token (where its log-prob is
read: the forward that chose it). It is the batch's ``routing/own_agreement``
(:mod:`miles_trainer_common.routing`) token by token: what the agreement would be without
replay.

The router hooks keep their counts per position of each forward's input
(:meth:`~miles_trainer_common.routing.RoutingReplay.per_position`); :class:`TokenAgreement`
reads them at the positions the log-probs are read at, in the layout the policy's forward
used: one right-padded sequence per sample, or a group's samples sharing their prompt
(:func:`~miles_trainer_common.layout.shared_layout`, whose positions :func:`forward_positions`
computes without building its attention mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles_trainer_common.batch import PackedBatch
from miles_trainer_common.logprobs import by_group

if TYPE_CHECKING:
    from miles_trainer_common.worker import Round, TrainerRank

#: a forward's input shape ``(rows, L)``, and per sample ``unit`` ``[b]``, ``pos`` and
#: ``valid`` ``[b, t]``: its row, the position whose output predicts response token ``j``, and
#: whether ``j`` is inside the response
Positions = tuple[tuple[int, int], Tensor, Tensor, Tensor]


def _alone(packed: PackedBatch, rows: list[int]) -> Positions:
    """One right-padded sequence per sample of ``rows``: response token ``j`` of a sample with
    a prompt of ``P`` tokens is predicted at ``P - 1 + j``."""
    index = torch.tensor(rows, dtype=torch.long)
    prompt = packed.prompt_lens[index]
    response = packed.response_lens[index]
    length = int((prompt + response).max())
    steps = torch.arange(max(1, int(response.max())))[None, :]
    pos = (prompt[:, None] - 1 + steps).clamp(max=length - 1)
    unit = torch.arange(len(rows), dtype=torch.long)
    return (len(rows), length), unit, pos, steps < response[:, None]


def _shared(packed: PackedBatch, rows: list[int], tile: int | None) -> Positions:
    """The positions of :func:`~miles_trainer_common.layout.shared_layout` (its ``unit``,
    ``pos``, ``valid`` and shape), from the prompts' and responses' lengths alone."""
    units: dict[tuple[int, ...], list[int]] = {}
    for r in rows:
        key = tuple(packed.input_ids[r, : int(packed.prompt_lens[r])].tolist())
        units.setdefault(key, []).append(r)
    # row -> (its unit, where its response starts, the position of the prompt's last token)
    where: dict[int, tuple[int, int, int]] = {}
    length = 0
    for u, (prompt, members) in enumerate(units.items()):
        n_prompt = len(prompt)
        shared = n_prompt if tile is None else n_prompt // tile * tile
        at = shared
        for r in members:
            n = n_prompt - shared + int(packed.response_lens[r])
            start = at + n_prompt - shared
            where[r] = (u, start, n_prompt - 1 if shared == n_prompt else start - 1)
            at += n if tile is None else -(-n // tile) * tile
        length = max(length, at)
    response = packed.response_lens[torch.tensor(rows, dtype=torch.long)]
    steps = torch.arange(max(1, int(response.max())))[None, :]
    unit, starts, last = (torch.tensor([where[r][i] for r in rows]) for i in range(3))
    pos = torch.where(steps == 0, last[:, None], starts[:, None] - 1 + steps)
    return (len(units), length), unit, pos.clamp(max=length - 1), steps < response[:, None]


def forward_positions(
    packed: PackedBatch, rows: list[int], share_prompts: bool, tile: int | None
) -> Positions:
    """Where the policy's forward of samples ``rows`` reads each response token's log-prob:
    the shared-prompt layout (with ``share_prompts``; ``tile``: true on-policy mode's, which
    falls back to one sequence per sample when it would forward no fewer tokens), else one
    sequence per sample."""
    if not share_prompts:
        return _alone(packed, rows)
    shared = _shared(packed, rows, tile)
    if tile is not None:
        rows_f, length = shared[0]
        longest = int(packed.seq_lens[torch.tensor(rows, dtype=torch.long)].max())
        if rows_f * length >= len(rows) * longest:
            return _alone(packed, rows)
    return shared


class TokenAgreement:
    """The agreement per response token of ``packed``'s samples, filled one forward (one
    micro-batch of rows) at a time by :meth:`take` from ``forwards`` (the list
    :meth:`~miles_trainer_common.routing.RoutingReplay.per_position` yields), the policy's
    forward laid out as ``share_prompts`` and ``tile`` say (:func:`forward_positions`); the
    counts stay on ``device`` until :meth:`result`."""

    def __init__(
        self,
        packed: PackedBatch,
        forwards: list[Tensor],
        share_prompts: bool,
        tile: int | None,
        device: torch.device,
    ) -> None:
        self.packed = packed
        self.forwards = forwards
        self.share_prompts = share_prompts
        self.tile = tile
        #: per sample and response token: layers whose own top-k agreed, layers with a record
        self.counts = torch.zeros(2, packed.size, packed.width, device=device)

    def add(self, rows: list[int], forward: Tensor) -> None:
        """Take the counts ``[rows_f, L, 2]`` per position of the forward of samples ``rows``
        (:meth:`~miles_trainer_common.routing.RoutingReplay.per_position`)."""
        shape, unit, pos, valid = forward_positions(
            self.packed, rows, self.share_prompts, self.tile
        )
        if tuple(forward.shape[:2]) != shape:
            raise RuntimeError(
                f"expert agreement: the policy's forward of {len(rows)} samples had an input "
                f"of {tuple(forward.shape[:2])} positions, and its layout ("
                f"{'shared prompts' if self.share_prompts else 'one sequence per sample'}) "
                f"has {shape}"
            )
        device = forward.device
        picked = forward[unit.to(device)[:, None], pos.to(device)]
        picked = picked * valid.to(device)[:, :, None]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        self.counts[:, index, : picked.shape[1]] = picked.permute(2, 0, 1)

    def take(self, rows: list[int] | None) -> None:
        """After one round of the policy's forward: :meth:`add` the forward of samples
        ``rows`` (``None``: a padding round, whose counts are dropped), emptying
        :attr:`forwards`."""
        taken = list(self.forwards)
        self.forwards.clear()
        if rows is None:
            return
        if len(taken) != 1:
            raise RuntimeError(
                f"expert agreement: {len(taken)} measured forwards in one round of the "
                "policy's forward; expected 1"
            )
        self.add(rows, taken[0])

    def result(self, reduce: Callable[[Tensor], object] | None = None) -> Tensor:
        """``[B, T]`` on CPU: each token's fraction of MoE layers that agreed, NaN where no
        layer had a record (padding included). ``reduce``: sums the counts over the ranks in
        place (each filled its own samples' rows) when there are several."""
        if reduce is not None:
            reduce(self.counts)
        same, known = self.counts.cpu()
        return torch.where(known > 0, same / known.clamp(min=1), torch.full_like(same, torch.nan))


def behaviour_logprobs(
    rank: TrainerRank,
    model: nn.Module,
    groups: list[Any],
    packed: PackedBatch,
    mine: list[list[int]],
    rounds: int,
    grad: bool,
) -> tuple[Tensor, Tensor, list[Round]]:
    """A step's forward of ``rank``'s policy before its update (``_logprobs`` with
    entropies); with router hooks, also each response token's expert agreement
    (:mod:`miles_trainer_common.agreement`), kept per group id in ``step_agreement``."""
    router = rank._routers.get(id(model))
    if router is None:
        return rank._logprobs(model, packed, mine, rounds, entropy=True, grad=grad)
    with router.per_position() as forwards:
        share, tile = rank.options.share_prompts, rank._tile
        agreement = TokenAgreement(packed, forwards, share, tile, rank.device)
        out = rank._logprobs(
            model, packed, mine, rounds, entropy=True, grad=grad, after=agreement.take
        )
    reduce = dist.all_reduce if rank.world_size > 1 else None
    rank.step_agreement.update(by_group(groups, agreement.result(reduce)))
    return out
