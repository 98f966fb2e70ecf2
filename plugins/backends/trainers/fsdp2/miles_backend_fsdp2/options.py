"""Options of the FSDP2 trainer backend (torch-free, validated when a run selects ``fsdp2``)."""

from __future__ import annotations

from typing import Literal

from miles_trainer_common.options import TrainerOptions
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Batch inputs this backend computes for an algorithm (the record's ``computes``): the
#: recomputed behaviour and reference log-probs, and a critic's values.
SUPPORTED_NEEDS = frozenset({"old_logprobs", "ref_logprobs", "values"})


class CriticOptions(BaseModel):
    """The critic (value model) the backend trains beside the policy when the algorithm needs
    ``values`` (PPO). AdamW's betas, epsilon and weight decay and the shape of the LR schedule
    (``lr_schedule``, ``decay_steps``, ``min_lr_ratio``) are the policy's."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None,
        description="Hugging Face checkpoint of the critic's body (None: the policy's); "
        "loaded as AutoModelForTokenClassification with one label, so the value head is new "
        "unless the checkpoint holds one",
    )
    lr: float = Field(default=1e-5, gt=0, description="peak learning rate of the critic's AdamW")
    warmup_steps: int = Field(default=0, ge=0, description="the critic's linear warm-up steps")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="clip the critic's global gradient norm (None: no clipping)"
    )


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
    critic: CriticOptions = Field(
        default_factory=CriticOptions,
        description="the critic, built only when the algorithm needs values (PPO)",
    )

    @model_validator(mode="after")
    def _critic_warmup_before_decay(self) -> FSDP2Options:
        if (
            self.lr_schedule == "cosine"
            and self.decay_steps is not None
            and self.decay_steps <= self.critic.warmup_steps
        ):
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must be greater than "
                f"critic.warmup_steps ({self.critic.warmup_steps})"
            )
        return self
