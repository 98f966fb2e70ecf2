"""The FSDP2 trainer the loop talks to (``miles_core.contracts.Trainer``), for any world size.

World size 1 runs the rank in this process (a real one-rank process group); world size N
spawns N worker processes. The plumbing is
:class:`miles_trainer_common.controller.TrainerController`'s.
"""

from __future__ import annotations

from typing import Any

from miles_trainer_common.controller import TrainerController

from miles_backend_fsdp2.options import SUPPORTED_NEEDS, FSDP2Options


class FSDP2Trainer(TrainerController):
    """A Hugging Face causal LM trained with FSDP2 (see the package README). The fingerprint
    holds, once a critic exists, its weights (``critic``) and its optimizer and schedule
    (``critic_optimizer``) too; checkpoints hold the critic's state. With adapters, it holds
    each adapter's tensors (``adapter/<name>``) and its optimizer and schedule
    (``optimizer/<name>``) too."""

    name = "fsdp2"
    worker = "miles_backend_fsdp2.worker:RankWorker"
    options_cls = "miles_backend_fsdp2.options:FSDP2Options"
    supported_needs = SUPPORTED_NEEDS


def build(
    options: FSDP2Options | None = None,
    adapter: Any = None,
    adapters: Any = None,
    routing: str = "none",
    true_on_policy: bool = False,
    ranks: Any = None,
) -> FSDP2Trainer:
    """Factory of the ``fsdp2`` trainer backend; ``adapters`` (each an
    ``miles_core.contracts.AdapterImpl`` with its own ``name``; ``adapter=x`` is
    ``adapters=[x]``) wrap the policy: only the adapters train, each on the groups that name
    it, with its own optimizer, and :meth:`~FSDP2Trainer.export_weights` streams one
    adapter's tensors alone. ``routing`` (the run's ``rollout.routing``): ``record``
    measures the expert agreement with the engine's routing record, ``replay`` routes every
    MoE layer by it (:mod:`miles_trainer_common.routing`). ``true_on_policy`` (the run's
    ``rollout.true_on_policy``): the forward runs the batch-invariant kernels
    (:mod:`miles_core.invariant.kernels`) and a step fails where a recomputed log-prob is not
    bitwise the engine's. ``ranks``: a placement's launcher of the ranks
    (:class:`miles_trainer_common.ranks.RankLauncher`; the ``placed_ranks`` declaration)."""
    options = options if options is not None else FSDP2Options()
    if true_on_policy:
        if options.precision != "fp32":
            raise ValueError(
                "fsdp2 options: precision must be 'fp32' with rollout.true_on_policy (the "
                f"batch-invariant kernels compute in float32); it is {options.precision!r}"
            )
        if options.attn_implementation != "sdpa":
            raise ValueError(
                "fsdp2 options: attn_implementation must be 'sdpa' with "
                "rollout.true_on_policy (the attention the kernels replace); it is "
                f"{options.attn_implementation!r}"
            )
    return FSDP2Trainer(
        options,
        adapter=adapter,
        adapters=adapters,
        routing=routing,
        true_on_policy=true_on_policy,
        ranks=ranks,
    )
