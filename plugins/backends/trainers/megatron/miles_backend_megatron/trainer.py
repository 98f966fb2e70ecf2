"""The Megatron trainer the loop talks to (``miles_core.contracts.Trainer``), for any layout:
one rank (tensor, pipeline and data parallel all 1) runs in this process on a real one-rank
process group; more ranks are spawned worker processes. The plumbing is
:class:`miles_trainer_common.controller.TrainerController`'s."""

from __future__ import annotations

from typing import Any

from miles_trainer_common.controller import TrainerController

from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions


class MegatronTrainer(TrainerController):
    """A Hugging Face Llama/Qwen3 checkpoint trained as a Megatron-core ``GPTModel`` (see the
    package README). The fingerprint holds, once a critic exists, its weights (``critic``)
    and its optimizer and schedule (``critic_optimizer``) too; checkpoints hold the critic's
    state. With adapters (``lora``; several on one base: each group trains the one it names),
    only their branches train; the fingerprint adds each adapter's tensors
    (``adapter/<name>``) and its optimizer and schedule (``optimizer/<name>``), ``weights``
    staying the frozen base's."""

    name = "megatron"
    worker = "miles_backend_megatron.worker:RankWorker"
    supported_needs = SUPPORTED_NEEDS

    def check(self, model_path: str) -> None:
        """Refuse, before any process starts or any weight is read, a model this backend
        cannot build or a split it cannot take (``plugin.check_model``)."""
        from miles_backend_megatron.plugin import check_model

        check_model(model_path, self.options)
        super().check(model_path)
        for adapter in self.adapters:
            if self.options.layer_spec == "transformer_engine":
                raise ValueError(
                    "backend.layer_spec 'transformer_engine' cannot carry an adapter (its "
                    "fused norm+linear hides the normalised input LoRA needs); use 'local' or "
                    "'auto' (which picks 'local' with an adapter)"
                )
            from miles_backend_megatron.lora import check_name, plan

            check_name(adapter.name)
            plan(adapter, model_path)  # a target this backend cannot adapt: refused now


def build(
    options: MegatronOptions | None = None,
    adapter: Any = None,
    adapters: Any = None,
    true_on_policy: bool = False,
    ranks: Any = None,
) -> MegatronTrainer:
    """Factory of the ``megatron`` trainer backend; ``adapters`` (each a ``lora`` adapter, a
    ``miles_lora.LoraAdapter`` with its own ``name``; ``adapter=x`` is ``adapters=[x]``) put
    LoRA branches on the policy's linears, one set each: only they train, each on the groups
    that name it, with its own optimizer, and :meth:`~MegatronTrainer.export_weights` streams
    one adapter's tensors alone. ``true_on_policy`` (the run's ``rollout.true_on_policy``):
    the policy runs the modules of :mod:`miles_backend_megatron.invariant`, and a step fails
    where a recomputed log-prob is not bitwise the engine's. ``ranks``: a placement's
    launcher of the ranks (:class:`miles_trainer_common.ranks.RankLauncher`; the
    ``placed_ranks`` declaration)."""
    options = options if options is not None else MegatronOptions()
    if options.distributed_optimizer and (adapter is not None or adapters):
        raise ValueError(
            "backend.distributed_optimizer: Megatron's distributed optimizer trains the whole "
            "policy; with an adapter (LoRA) use distributed_optimizer: false"
        )
    if true_on_policy:
        if options.tensor_parallel != 1:
            raise ValueError(
                "megatron options: tensor_parallel must be 1 with rollout.true_on_policy (a "
                "row-parallel product is summed across ranks in an order the all-reduce does "
                f"not fix); it is {options.tensor_parallel}"
            )
        if options.layer_spec == "transformer_engine":
            raise ValueError(
                "megatron options: layer_spec 'transformer_engine' cannot run "
                "rollout.true_on_policy (its fused kernels are not the engine's); use 'local' "
                "or 'auto'"
            )
    return MegatronTrainer(
        options, adapter=adapter, adapters=adapters, true_on_policy=true_on_policy, ranks=ranks
    )
