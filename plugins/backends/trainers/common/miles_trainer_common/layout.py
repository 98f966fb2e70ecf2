"""The shared-prompt layout of a micro-batch: the samples that share a prompt (a GRPO group)
as one sequence, the prompt once then every response, with the attention pattern and position
ids that give each response exactly what it would see alone.

Backend-blind: each backend turns :attr:`SharedLayout.sees` into its own mask convention and
:attr:`SharedLayout.position` into its own position encoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles_trainer_common.batch import PackedBatch


@dataclass
class SharedLayout:
    """One row per distinct prompt of the micro-batch (``U`` rows of ``L`` tokens).

    ``ids``/``position`` ``[U, L]``: the tokens, and position ids that restart after the prompt
    for every response; ``sees`` ``[U, L, L]``: query ``q`` attends key ``k`` (k <= q, of the
    prompt or of q's own response; a padding query sees only itself, so no row is empty).
    Per sample of ``rows``: ``unit`` ``[b]`` (its row), and ``pos``, ``target``, ``valid``
    ``[b, t]``: the position whose logits predict response token ``j``, that token, and
    whether ``j`` is inside the response. ``first``: no position before it predicts a
    response token (a head may skip them). ``routed`` ``[U, L, width]``: the engine's routing
    record at each position when the batch carries one (the prompt's from the first sample
    of its row: the prompt is forwarded once), -1 where there is none."""

    ids: Tensor
    position: Tensor
    sees: Tensor
    unit: Tensor
    pos: Tensor
    target: Tensor
    valid: Tensor
    first: int
    routed: Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


def _by_prompt(packed: PackedBatch, rows: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Rows ``rows`` of ``packed`` by their prompt's tokens, in order of first appearance."""
    units: dict[tuple[int, ...], list[int]] = {}
    for r in rows:
        key = tuple(packed.input_ids[r, : int(packed.prompt_lens[r])].tolist())
        units.setdefault(key, []).append(r)
    return units


def _sees(segment: Tensor) -> Tensor:
    """``[U, L, L]``: query sees key, causally, within the prompt (segment 0) or its own
    segment; never padding (-1), but every position itself."""
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    sees = causal & ((segment[:, None, :] == 0) | same) & (segment[:, None, :] >= 0)
    return sees | torch.eye(length, dtype=torch.bool)


def shared_layout(packed: PackedBatch, rows: list[int], tile: int | None = None) -> SharedLayout:
    """The layout of samples ``rows`` of ``packed`` (on CPU).

    ``tile`` (true on-policy mode: the attention kernel's key tile): every key sits at the
    same offset in the same order of tiles as in the sequence of its sample alone, so a tiled
    attention adds each query's keys exactly as it would there. Only the prompt's whole tiles
    are shared; each response's segment starts on a tile boundary with its own copy of the
    prompt's last partial tile (the prompt tokens past the last whole tile), and segments are
    padded to whole tiles."""
    units = _by_prompt(packed, rows)
    prompts = list(units)

    def shared_part(n_prompt: int) -> int:
        return n_prompt if tile is None else n_prompt // tile * tile

    def span(n: int) -> int:  # a segment's room: whole tiles when aligned
        return n if tile is None else -(-n // tile) * tile

    lengths = [
        shared_part(len(p))
        + sum(span(len(p) - shared_part(len(p)) + int(packed.response_lens[r])) for r in units[p])
        for p in prompts
    ]
    n_units, length = len(prompts), max(lengths)
    ids = torch.zeros(n_units, length, dtype=torch.long)
    position = torch.zeros(n_units, length, dtype=torch.long)
    segment = torch.full((n_units, length), -1, dtype=torch.long)  # -1: padding, 0: prompt
    width = max(1, max(int(packed.response_lens[r]) for r in rows))
    where: dict[int, tuple[int, int]] = {}  # row -> (unit, offset of its response)
    record = packed.routed_experts
    routed = None
    if record is not None:
        routed = torch.full((n_units, length, record.shape[2]), -1, dtype=record.dtype)
    for u, prompt in enumerate(prompts):
        n_prompt = len(prompt)
        shared = shared_part(n_prompt)  # the prompt tokens every response sees in place
        ids[u, :shared] = torch.tensor(prompt[:shared], dtype=torch.long)
        position[u, :shared] = torch.arange(shared)
        segment[u, :shared] = 0
        if routed is not None and record is not None:
            routed[u, :shared] = record[units[prompt][0], :shared]
        at = shared
        for k, r in enumerate(units[prompt]):
            # the segment: the prompt's unshared tail (none without a tile), then the response
            n = n_prompt - shared + int(packed.response_lens[r])
            ids[u, at : at + n] = packed.input_ids[r, shared : shared + n]
            if routed is not None and record is not None:
                routed[u, at : at + n] = record[r, shared : shared + n]
            position[u, at : at + n] = shared + torch.arange(n)
            segment[u, at : at + n] = k + 1
            where[r] = (u, at + n_prompt - shared)  # where its response starts
            at += span(n)
    sees = _sees(segment)
    # Response token j is predicted at the position before it: the prompt's last for j = 0.
    index = torch.tensor(rows, dtype=torch.long)
    response = packed.response_lens[index]
    steps = torch.arange(width)[None, :]
    unit = torch.tensor([where[r][0] for r in rows], dtype=torch.long)
    start = torch.tensor([where[r][1] for r in rows], dtype=torch.long)
    # the prompt's last token: in the shared part, or the last of the segment's own tail
    last = torch.tensor(
        [
            len(p) - 1 if shared_part(len(p)) == len(p) else where[r][1] - 1
            for r in rows
            for p in [prompts[where[r][0]]]
        ],
        dtype=torch.long,
    )
    pos = torch.where(steps == 0, last[:, None], start[:, None] - 1 + steps).clamp(max=length - 1)
    target = ids[unit[:, None], (start[:, None] + steps).clamp(max=length - 1)]
    valid = steps < response[:, None]
    return SharedLayout(ids, position, sees, unit, pos, target, valid, int(last.min()), routed)
