"""The Megatron trainer the loop talks to (``miles_core.contracts.Trainer``), for any layout:
one rank (tensor, pipeline and data parallel all 1) runs in this process on a real one-rank
process group; more ranks are spawned worker processes. The plumbing is
:class:`miles_trainer_common.controller.TrainerController`'s."""

from __future__ import annotations

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
    state."""

    name = "megatron"
    worker = "miles_backend_megatron.worker:RankWorker"

    def check(self, model_path: str) -> None:
        """Refuse, before any process starts or any weight is read, a model this backend
        cannot build or a split it cannot take (``plugin.check_model``)."""
        from miles_backend_megatron.plugin import check_model

        check_model(model_path, self.options)

    def check_algorithm(self, algorithm: AlgorithmImpl) -> None:
        check_needs(algorithm, SUPPORTED_NEEDS, self.name)

    def compute_values(self, groups: list[Group]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens (beyond the contract; no
        grad, on CPU, 0 on padding); the critic is built first if no step has needed it."""
        pack(groups)
        values: Tensor = self._call("compute_values", groups)
        return values


def build(options: MegatronOptions | None = None) -> MegatronTrainer:
    """Factory of the ``megatron`` trainer backend."""
    return MegatronTrainer(options if options is not None else MegatronOptions())
