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


def shared_layout(packed: PackedBatch, rows: list[int]) -> SharedLayout:
    """The layout of samples ``rows`` of ``packed`` (on CPU)."""
    units: dict[tuple[int, ...], list[int]] = {}
    for r in rows:
        key = tuple(packed.input_ids[r, : int(packed.prompt_lens[r])].tolist())
        units.setdefault(key, []).append(r)
    prompts = list(units)
    lengths = [len(p) + sum(int(packed.response_lens[r]) for r in units[p]) for p in prompts]
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
        ids[u, :n_prompt] = torch.tensor(prompt, dtype=torch.long)
        position[u, :n_prompt] = torch.arange(n_prompt)
        segment[u, :n_prompt] = 0
        if routed is not None and record is not None:
            routed[u, :n_prompt] = record[units[prompt][0], :n_prompt]
        at = n_prompt
        for k, r in enumerate(units[prompt]):
            n = int(packed.response_lens[r])
            ids[u, at : at + n] = packed.input_ids[r, n_prompt : n_prompt + n]
            if routed is not None and record is not None:
                routed[u, at : at + n] = record[r, n_prompt : n_prompt + n]
            position[u, at : at + n] = n_prompt + torch.arange(n)
            segment[u, at : at + n] = k + 1
            where[r] = (u, at)
            at += n
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    sees = causal & ((segment[:, None, :] == 0) | same) & (segment[:, None, :] >= 0)
    sees |= torch.eye(length, dtype=torch.bool)
    # Response token j is predicted at the position before it: the prompt's last for j = 0.
    index = torch.tensor(rows, dtype=torch.long)
    response = packed.response_lens[index]
    steps = torch.arange(width)[None, :]
    unit = torch.tensor([where[r][0] for r in rows], dtype=torch.long)
    start = torch.tensor([where[r][1] for r in rows], dtype=torch.long)
    last = torch.tensor([len(prompts[where[r][0]]) - 1 for r in rows], dtype=torch.long)
    pos = torch.where(steps == 0, last[:, None], start[:, None] - 1 + steps).clamp(max=length - 1)
    target = ids[unit[:, None], (start[:, None] + steps).clamp(max=length - 1)]
    return SharedLayout(
        ids=ids,
        position=position,
        sees=sees,
        unit=unit,
        pos=pos,
        target=target,
        valid=steps < response[:, None],
        first=min(len(p) for p in prompts) - 1,
        routed=routed,
    )
