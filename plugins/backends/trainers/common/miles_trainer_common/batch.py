"""Groups to padded tensors, the ``TokenBatch`` of an algorithm, and the micro-batch plan.

Every sample is one sequence ``prompt_ids + response_ids``; the trained positions are the
response tokens, so the per-token tensors are ``[B, T]`` with ``T`` the longest response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_core.contracts import TokenBatch
from miles_core.data import Group, Sample
from miles_trainer_common.truncation import Truncation, batch_truncation, sample_params


@dataclass
class PackedBatch:
    """Right-padded sequences of a list of groups, on CPU.

    Attributes:
        input_ids: ``[B, L]`` prompt + response ids, right-padded with 0.
        prompt_lens: ``[B]`` prompt lengths (each >= 1: the first response token needs a logit).
        response_lens: ``[B]`` response lengths.
        response_mask: ``[B, T]`` the samples' ``loss_mask`` (0 on padding).
        rollout_logprobs: ``[B, T]`` the engine's log-probs (0 on padding).
        rewards: ``[B]`` rewards (NaN where a sample has none).
        group_index: ``[B]`` index of each sample's group in the list given.
        teacher_logprobs: ``[B, T]`` a distillation teacher's log-probs (0 on padding), when
            the samples carry them; ``None`` otherwise.
        routed_experts: ``[B, L, width]`` int16, the engine's routing record of each
            sequence position (``width`` = layers x top-k expert ids; -1 on padding, on the
            last token, which is never forwarded, and in dense layers), when the samples carry
            one; ``None`` otherwise.
        routing_bytes: bytes of the samples' routing records (0 without).
        turn_rewards: ``[B, T]`` each generated turn's reward (``Sample.turn_rewards``) on
            the turn's last trained token (0 elsewhere), when a sample has turn rewards;
            ``None`` otherwise.
        truncation: the samples' sampling parameters when one was drawn with top-p or top-k
            (``Sample.sampling_params``, :mod:`miles_trainer_common.truncation`):
            the policy's log-probs are then those of the truncated distribution; ``None``
            otherwise.
    """

    input_ids: Tensor
    prompt_lens: Tensor
    response_lens: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    group_index: Tensor
    teacher_logprobs: Tensor | None = None
    routed_experts: Tensor | None = None
    routing_bytes: int = 0
    turn_rewards: Tensor | None = None
    truncation: Truncation | None = None

    @property
    def size(self) -> int:
        """Number of samples ``B``."""
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        """Response width ``T``."""
        return int(self.response_mask.shape[1])

    @property
    def seq_lens(self) -> Tensor:
        """``[B]`` unpadded sequence lengths."""
        return self.prompt_lens + self.response_lens


def pack(groups: list[Group]) -> PackedBatch:
    """Pad the samples of ``groups`` (in order) into tensors; raises on malformed samples."""
    samples = [(gi, s) for gi, g in enumerate(groups) for s in g.samples]
    if not samples:
        raise ValueError("no samples: the trainer needs at least one group with one sample")
    for gi, s in samples:
        s.check()
        if not s.prompt_ids:
            raise ValueError(
                f"a sample of group {gi} has an empty prompt: the first response token's "
                "log-prob needs at least one token before it"
            )
    b = len(samples)
    seq = max(len(s.prompt_ids) + len(s.response_ids) for _, s in samples)
    width = max(1, max(len(s.response_ids) for _, s in samples))
    input_ids = torch.zeros(b, seq, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    rollout = torch.zeros(b, width, dtype=torch.float32)
    taught = [s.teacher_logprobs is not None for _, s in samples]
    if any(taught) and not all(taught):
        raise ValueError(
            f"samples {[i for i, t in enumerate(taught) if not t]} have no teacher log-probs "
            "while the others have: a batch is scored by the teacher whole or not at all"
        )
    teacher = torch.zeros(b, width, dtype=torch.float32) if all(taught) else None
    routed = _routed_experts([s for _, s in samples], seq)
    for i, (_, s) in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        n = len(s.response_ids)
        if n:
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
            if teacher is not None:
                teacher[i, :n] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    return PackedBatch(
        input_ids=input_ids,
        prompt_lens=torch.tensor([len(s.prompt_ids) for _, s in samples], dtype=torch.long),
        response_lens=torch.tensor([len(s.response_ids) for _, s in samples], dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=rollout,
        rewards=torch.tensor(
            [math.nan if s.reward is None else float(s.reward) for _, s in samples],
            dtype=torch.float32,
        ),
        group_index=torch.tensor([gi for gi, _ in samples], dtype=torch.long),
        teacher_logprobs=teacher,
        routed_experts=routed,
        routing_bytes=sum(
            s.routed_experts.nbytes for _, s in samples if s.routed_experts is not None
        ),
        turn_rewards=_turn_rewards([s for _, s in samples], width),
        truncation=batch_truncation(
            [sample_params(s.sampling_params, f"sample {i}") for i, (_, s) in enumerate(samples)]
        ),
    )


def _turn_rewards(samples: list[Sample], width: int) -> Tensor | None:
    """Each turn's reward on its last trained token ``[B, T]``; ``None`` when no sample has
    turn rewards (a sample without them gets none: its episode reward is all it earns)."""
    if all(s.turn_rewards is None for s in samples):
        return None
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, s in enumerate(samples):
        for (_, end), value in zip(s.turns(), s.turn_rewards or [], strict=False):
            out[i, end - 1] = float(value)
    return out


def _routed_experts(samples: list[Sample], seq: int) -> Tensor | None:
    """The samples' routing records as one ``[B, seq, width]`` int16 tensor (-1 where there
    is none); ``None`` when no sample has one. Mixed batches are refused: a batch is routed
    by the engine's record whole or not at all."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"samples {[i for i, h in enumerate(have) if not h]} have no routed_experts while "
            "the others have: the engine returned no routing record for them"
        )
    widths = {s.routed_experts.width for s in samples if s.routed_experts is not None}
    if len(widths) != 1:
        raise ValueError(f"the samples' routing records differ in width: {sorted(widths)}")
    out = torch.full((len(samples), seq, widths.pop()), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        record = s.routed_experts
        assert record is not None
        if record.positions:
            ids = torch.frombuffer(bytearray(record.data), dtype=_DTYPES[record.itemsize])
            out[i, : record.positions] = ids.view(record.positions, record.width).to(torch.int16)
    return out


#: a record's ids by item size (little-endian, as the record stores them)
_DTYPES = {1: torch.int8, 2: torch.int16}


def token_batch(packed: PackedBatch) -> TokenBatch:
    """The algorithm's view of a packed batch (optional fields are filled by the trainer)."""
    if torch.isnan(packed.rewards).any():
        missing = torch.isnan(packed.rewards).nonzero().flatten().tolist()
        raise ValueError(f"samples {missing} have no reward: score them before training")
    return TokenBatch(
        response_mask=packed.response_mask.clone(),
        rollout_logprobs=packed.rollout_logprobs.clone(),
        rewards=packed.rewards.clone(),
        group_index=packed.group_index.clone(),
        teacher_logprobs=(
            None if packed.teacher_logprobs is None else packed.teacher_logprobs.clone()
        ),
        turn_rewards=None if packed.turn_rewards is None else packed.turn_rewards.clone(),
    )


def plan_micro_batches(seq_lens: list[int], budget: int) -> list[list[int]]:
    """Split sample indices, in order, into micro-batches whose padded size
    (samples x longest sequence) fits ``budget`` tokens; a longer sample goes alone."""
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(seq_lens):
        grown = max(longest, n)
        if current and grown * (len(current) + 1) > budget:
            out.append(current)
            current, grown = [], n
        current.append(i)
        longest = grown
    if current:
        out.append(current)
    return out


def plan_by_length(seq_lens: list[int], budget: int) -> list[list[int]]:
    """Like :func:`plan_micro_batches`, over the samples sorted by length (longest first, ties
    in order): neighbours in a micro-batch have similar lengths, so little of it is padding.

    Deterministic, so every rank computes the same plan from the same batch."""
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    plan = plan_micro_batches([seq_lens[i] for i in order], budget)
    return [[order[j] for j in mb] for mb in plan]


def plan_groups(packed: PackedBatch, budget: int) -> list[list[int]]:
    """Micro-batches of whole groups, for the shared-prompt forward: a group costs one row of
    its prompt followed by all its responses, and groups are planned by that length, longest
    first, as :func:`plan_by_length` plans samples. Samples in group order within a group."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(packed.group_index.tolist()):
        members.setdefault(int(g), []).append(i)
    groups = list(members.values())
    lens = [
        int(packed.prompt_lens[rows].max()) + int(packed.response_lens[rows].sum())
        for rows in groups
    ]
    return [[i for k in mb for i in groups[k]] for mb in plan_by_length(lens, budget)]


def assign_to_ranks(
    micro_batches: list[list[int]], seq_lens: list[int], world_size: int
) -> list[list[list[int]]]:
    """Give each rank its micro-batches, balancing padded tokens greedily (largest first).

    Deterministic, so every rank computes the same plan from the same batch."""
    cost = [max(seq_lens[i] for i in mb) * len(mb) for mb in micro_batches]
    order = sorted(range(len(micro_batches)), key=lambda k: (-cost[k], k))
    load = [0] * world_size
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for k in order:
        r = min(range(world_size), key=lambda q: (load[q], q))
        per_rank[r].append(k)
        load[r] += cost[k]
    return [[micro_batches[k] for k in sorted(ks)] for ks in per_rank]
