"""Options of the FSDP2 trainer backend (torch-free, validated when a run selects ``fsdp2``).

``CriticOptions`` (the ``critic:`` block) is :mod:`miles_trainer_common.options`'s, shared with
the Megatron backend; it is re-exported here."""

from __future__ import annotations

from typing import Literal

from miles_trainer_common.options import CriticOptions, TrainerOptions
from pydantic import Field

__all__ = ["SUPPORTED_NEEDS", "CriticOptions", "FSDP2Options"]

#: Batch inputs this backend computes for an algorithm (the record's ``computes``): the
#: recomputed behaviour and reference log-probs, and a critic's values.
SUPPORTED_NEEDS = frozenset({"old_logprobs", "ref_logprobs", "values"})


class FSDP2Options(TrainerOptions):
    """Options of the ``fsdp2`` trainer backend: those every trainer backend takes
    (:class:`~miles_trainer_common.options.TrainerOptions`: device, AdamW, its schedule,
    clipping, micro-batches, seeding, the weight stream) and FSDP2's own.

    A bad value is a pydantic ``ValidationError`` naming the field and what is allowed.
    """

    world_size: int = Field(
        default=1,
        ge=1,
        description="data-parallel ranks; 1 runs in-process, N > 1 spawns N workers",
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="'bf16': FSDP2 mixed precision (bf16 compute, fp32 master weights and "
        "gradient reduction); 'fp32': everything in float32",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        default="sdpa", description="Hugging Face attention implementation"
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="FSDP2: free gathered parameters after forward (ZeRO-3) or keep them",
    )
