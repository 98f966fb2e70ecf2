"""The Megatron trainer the loop talks to (``miles_core.contracts.Trainer``), for any layout:
one rank (tensor, pipeline and data parallel all 1) runs in this process on a real one-rank
process group; more ranks are spawned worker processes. The plumbing is
:class:`miles_trainer_common.controller.TrainerController`'s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles_trainer_common.batch import pack
from miles_trainer_common.controller import TrainerController
from miles_trainer_common.rank import check_needs
from torch import Tensor

from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_core.contracts import AlgorithmImpl
from miles_core.data import Group


class MegatronTrainer(TrainerController):
    """A Hugging Face Llama/Qwen3 checkpoint trained as a Megatron-core ``GPTModel`` (see the
    package README). The fingerprint holds, once a critic exists, its weights (``critic``)
    and its optimizer and schedule (``critic_optimizer``) too; checkpoints hold the critic's
    state. With an adapter (``lora``), only its branches train; the fingerprint adds its
    tensors (``adapter/<name>``), ``weights`` staying the frozen base's."""

    name = "megatron"
    worker = "miles_backend_megatron.worker:RankWorker"

    def check(self, model_path: str) -> None:
        """Refuse, before any process starts or any weight is read, a model this backend
        cannot build or a split it cannot take (``plugin.check_model``)."""
        from miles_backend_megatron.plugin import check_model

        check_model(model_path, self.options)
        if len(self.adapters) > 1:
            raise ValueError(
                "the megatron backend trains one adapter per run; "
                f"{', '.join(a.name for a in self.adapters)} were given (several adapters "
                "on one base: backend fsdp2)"
            )
        for adapter in self.adapters:
            config = adapter.engine_config()
            if config.get("lora_dropout"):
                raise ValueError(
                    f"adapter.dropout {config['lora_dropout']}: the megatron backend runs the "
                    "model in eval mode (the log-probs the gradient is taken at must equal the "
                    "recomputed ones), so the adapter's dropout would never apply; set it to 0"
                )
            if self.options.layer_spec == "transformer_engine":
                raise ValueError(
                    "backend.layer_spec 'transformer_engine' cannot carry an adapter (its "
                    "fused norm+linear hides the normalised input LoRA needs); use 'local' or "
                    "'auto' (which picks 'local' with an adapter)"
                )
            from miles_backend_megatron.lora import plan

            plan(adapter, model_path)  # a target this backend cannot adapt: refused now

    def export_model(self, adapter: str | None = None) -> Iterator[tuple[str, Tensor]]:
        """The whole policy as plain Hugging Face weights, the adapter merged in (``W +
        scaling * B @ A``), one tensor at a time; without an adapter, as
        :meth:`export_weights`."""
        return self._export("export_model", **self._adapter_kwargs(adapter))

    def save_adapter(self, path: str, adapter: str | None = None) -> None:
        """The adapter in PEFT's format under the folder ``path`` (``adapter_model.safetensors``,
        ``adapter_config.json``), loadable by ``peft.PeftModel.from_pretrained(base, path)``."""
        if not self.adapters:
            raise RuntimeError("save_adapter: this megatron trainer was built without an adapter")
        self._call("save_adapter", path, **self._adapter_kwargs(adapter))

    def check_algorithm(self, algorithm: AlgorithmImpl) -> None:
        check_needs(algorithm, SUPPORTED_NEEDS, self.name)

    def compute_values(self, groups: list[Group]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens (beyond the contract; no
        grad, on CPU, 0 on padding); the critic is built first if no step has needed it."""
        pack(groups)
        values: Tensor = self._call("compute_values", groups)
        return values


def build(options: MegatronOptions | None = None, adapter: Any = None) -> MegatronTrainer:
    """Factory of the ``megatron`` trainer backend; ``adapter`` (the ``lora`` adapter, a
    ``miles_lora.LoraAdapter``) puts LoRA branches on the policy's linears: only they train,
    and :meth:`~MegatronTrainer.export_weights` streams their tensors alone."""
    return MegatronTrainer(options if options is not None else MegatronOptions(), adapter=adapter)
