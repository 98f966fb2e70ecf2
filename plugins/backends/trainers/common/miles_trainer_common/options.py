"""The options every trainer backend takes (torch-free): the optimizer and its schedule, the
micro-batches, seeding, the weight stream, threads and timeouts. A backend's options model
subclasses :class:`TrainerOptions` and adds its own (its parallelism, its precision...).

:class:`CriticOptions` is the ``critic:`` block: every trainer rank builds a critic (PPO's
value model) beside the policy when the algorithm needs values."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class CriticOptions(BaseModel):
    """The critic (value model) a backend trains beside the policy when the algorithm needs
    ``values`` (PPO): the policy's body with a ``Linear(hidden, 1)`` value head in place of the
    vocabulary head. AdamW's betas, epsilon and weight decay and the shape of the LR schedule
    (``lr_schedule``, ``decay_steps``, ``min_lr_ratio``) are the policy's."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None,
        description="Hugging Face checkpoint of the critic's body (None: the policy's); the "
        "value head is new (drawn from the seed) unless the checkpoint holds one",
    )
    lr: float = Field(default=1e-5, gt=0, description="peak learning rate of the critic's AdamW")
    warmup_steps: int = Field(default=0, ge=0, description="the critic's linear warm-up steps")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="clip the critic's global gradient norm (None: no clipping)"
    )


class TrainerOptions(BaseModel):
    """Options shared by the trainer backends. A bad value is a pydantic ``ValidationError``
    naming the field and what is allowed; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)"
    )
    lr: float = Field(default=1e-6, gt=0, description="peak learning rate of AdamW")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999), description="AdamW betas, each in [0, 1)"
    )
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(
        default=0, ge=0, description="linear warm-up steps from lr/warmup to lr"
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant",
        description="after warm-up: constant, or cosine decay to min_lr_ratio * lr",
    )
    decay_steps: int | None = Field(
        default=None,
        gt=0,
        description="step at which the cosine reaches its floor (warm-up included)",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="cosine floor as a fraction of lr"
    )
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="clip the global gradient norm to this (None: no clipping)"
    )
    micro_batch_tokens: int = Field(
        default=8192,
        gt=0,
        description="token budget of one micro-batch (padded length x samples; samples are "
        "grouped by length, longest first); gradients are accumulated across micro-batches so "
        "the update equals one big batch",
    )
    keep_activations: bool = Field(
        default=True,
        description="True: every micro-batch runs forward once, with grad, and keeps its "
        "activations until the whole batch's loss is taken (one forward and one backward per "
        "step; activation memory of the whole batch). False: a no-grad forward of the whole "
        "batch first, then forward + backward one micro-batch at a time (one more forward; "
        "activation memory of one micro-batch)",
    )
    share_prompts: bool = Field(
        default=True,
        description="samples with the same prompt (a GRPO group) are forwarded as one "
        "sequence, the prompt once then every response, under a block attention mask: the "
        "same log-probs for fewer tokens; micro-batches then hold whole groups",
    )
    seed: int = Field(default=0, ge=0, description="seed of torch, random and numpy on every rank")
    export_dtype: Literal["fp32", "bf16"] | None = Field(
        default=None, description="dtype of export_weights (None: the trained fp32 weights)"
    )
    cpu_threads: int | None = Field(
        default=None, ge=1, description="torch threads per rank on CPU (None: cores / ranks)"
    )
    timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="a worker or collective that stays silent this long is an error",
    )
    critic: CriticOptions = Field(
        default_factory=CriticOptions,
        description="the critic, built only when the algorithm needs values (PPO)",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for beta in value:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"each beta must be in [0, 1) (got {value})")
        return value

    @model_validator(mode="after")
    def _cosine_needs_decay_steps(self) -> TrainerOptions:
        if self.lr_schedule == "cosine":
            if self.decay_steps is None:
                raise ValueError(
                    "lr_schedule 'cosine' needs decay_steps (the step where the cosine reaches "
                    "min_lr_ratio * lr)"
                )
            if self.decay_steps <= self.warmup_steps:
                raise ValueError(
                    f"decay_steps ({self.decay_steps}) must be greater than warmup_steps "
                    f"({self.warmup_steps})"
                )
        check_critic_schedule(self, self.critic)
        return self


def check_critic_schedule(options: TrainerOptions, critic: CriticOptions) -> None:
    """Refuse a critic whose warm-up does not end before the policy's cosine decays (the
    critic's schedule has the policy's shape); raises ``ValueError`` for a model validator."""
    if (
        options.lr_schedule == "cosine"
        and options.decay_steps is not None
        and options.decay_steps <= critic.warmup_steps
    ):
        raise ValueError(
            f"decay_steps ({options.decay_steps}) must be greater than "
            f"critic.warmup_steps ({critic.warmup_steps})"
        )
