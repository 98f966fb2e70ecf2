"""Options of the Megatron-core trainer backend (torch-free, validated when a run selects
``megatron``)."""

from __future__ import annotations

from typing import Literal

from miles_trainer_common.options import TrainerOptions
from pydantic import Field

#: Batch inputs this backend computes for an algorithm (the record's ``computes``): the
#: recomputed behaviour and reference log-probs, and a critic's values (a teacher's log-probs
#: come with the samples).
SUPPORTED_NEEDS = frozenset({"old_logprobs", "ref_logprobs", "values"})


class MegatronOptions(TrainerOptions):
    """Options of the ``megatron`` trainer backend: those every trainer backend takes
    (:class:`~miles_trainer_common.options.TrainerOptions`: AdamW, its schedule, clipping,
    micro-batches, seeding, the weight stream), its layout and layer spec, and the critic PPO
    trains beside the policy (built only when the algorithm needs values).

    The ranks are ``tensor_parallel x pipeline_parallel x data_parallel`` processes (one
    in-process rank when all three are 1). Whether the model's heads, key/value groups,
    vocabulary and layers divide by these is checked at set-up, against the model's config,
    before any weight is read. A bad value is a pydantic ``ValidationError`` naming the field
    and what is allowed.
    """

    tensor_parallel: int = Field(
        default=1, ge=1, description="tensor-parallel ranks (must divide heads, groups, vocab)"
    )
    pipeline_parallel: int = Field(
        default=1, ge=1, description="pipeline stages (must divide the decoder layers)"
    )
    data_parallel: int = Field(default=1, ge=1, description="data-parallel replicas")
    layer_spec: Literal["auto", "local", "transformer_engine"] = Field(
        default="auto",
        description="Megatron's layer spec: 'local' (Megatron-core's own modules; the only one "
        "on CPU), 'transformer_engine' (needs a GPU and Transformer Engine), or 'auto': "
        "Transformer Engine's on a GPU where it is installed, else local",
    )
    distributed_optimizer: bool = Field(
        default=False,
        description="Megatron's distributed optimizer for the policy: optimizer state sharded "
        "over the data-parallel replicas, gradients reduce-scattered in Megatron's buffers "
        "(full fine-tuning; refused with an adapter); false: a plain AdamW on each rank, "
        "gradients all-reduced",
    )

    @property
    def world_size(self) -> int:
        """The number of ranks: tensor x pipeline x data parallel."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
