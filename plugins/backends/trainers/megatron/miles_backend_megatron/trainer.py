"""The Megatron trainer the loop talks to (``miles_core.contracts.Trainer``), for any layout:
one rank (tensor, pipeline and data parallel all 1) runs in this process on a real one-rank
process group; more ranks are spawned worker processes. The plumbing is
:class:`miles_trainer_common.controller.TrainerController`'s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles_trainer_common.batch import pack
from miles_trainer_common.controller import TrainerController
from miles_trainer_common.rank import check_algorithm
from torch import Tensor

from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_core.contracts import AlgorithmImpl
from miles_core.data import Group


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

    def check(self, model_path: str) -> None:
        """Refuse, before any process starts or any weight is read, a model this backend
        cannot build or a split it cannot take (``plugin.check_model``)."""
        from miles_backend_megatron.plugin import check_model

        check_model(model_path, self.options)
        for adapter in self.adapters:
            config = adapter.engine_config()
            if config.get("lora_dropout"):
                raise ValueError(
                    f"adapter.dropout {config['lora_dropout']}: the megatron backend runs the "
                    "model in eval mode (the log-probs the gradient is taken at must equal the "
                    "recomputed ones), so the adapter's dropout would never apply; set it to 0 "
                    f"(adapter {adapter.name!r})"
                )
            if self.options.layer_spec == "transformer_engine":
                raise ValueError(
                    "backend.layer_spec 'transformer_engine' cannot carry an adapter (its "
                    "fused norm+linear hides the normalised input LoRA needs); use 'local' or "
                    "'auto' (which picks 'local' with an adapter)"
                )
            from miles_backend_megatron.lora import check_name, plan

            check_name(adapter.name)
            plan(adapter, model_path)  # a target this backend cannot adapt: refused now

    def export_model(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """The whole policy as plain Hugging Face weights, the adapter named ``adapter``
        (``None``: the only one) merged in (``W + scaling * B @ A``), no other adapter, one
        tensor at a time; without an adapter, as :meth:`export_weights`."""
        return self._export("export_model", **self._adapter_kwargs(adapter))

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """The adapter named ``adapter`` (``None``: the only one) in PEFT's format under the
        folder ``path`` (``adapter_model.safetensors``, ``adapter_config.json``), loadable by
        ``peft.PeftModel.from_pretrained(base, path)``."""
        if not self.adapters:
            raise RuntimeError("save_adapter: this megatron trainer was built without an adapter")
        self._call("save_adapter", path, **self._adapter_kwargs(adapter))

    def check_algorithm(self, algorithm: AlgorithmImpl) -> None:
        """Refuse an algorithm whose inputs the backend cannot compute, or a critic with
        several adapters (:func:`miles_trainer_common.rank.check_algorithm`)."""
        check_algorithm(algorithm, SUPPORTED_NEEDS, self.name, len(self.adapters))

    def compute_values(self, groups: list[Group]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens (beyond the contract; no
        grad, on CPU, 0 on padding); the critic is built first if no step has needed it."""
        pack(groups)
        values: Tensor = self._call("compute_values", groups)
        return values


def build(
    options: MegatronOptions | None = None,
    adapter: Any = None,
    adapters: Any = None,
    true_on_policy: bool = False,
) -> MegatronTrainer:
    """Factory of the ``megatron`` trainer backend; ``adapters`` (each a ``lora`` adapter, a
    ``miles_lora.LoraAdapter`` with its own ``name``; ``adapter=x`` is ``adapters=[x]``) put
    LoRA branches on the policy's linears, one set each: only they train, each on the groups
    that name it, with its own optimizer, and :meth:`~MegatronTrainer.export_weights` streams
    one adapter's tensors alone. ``true_on_policy`` (the run's ``rollout.true_on_policy``):
    the policy runs the modules of :mod:`miles_backend_megatron.invariant`, and a step fails
    where a recomputed log-prob is not bitwise the engine's."""
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
        options, adapter=adapter, adapters=adapters, true_on_policy=true_on_policy
    )
