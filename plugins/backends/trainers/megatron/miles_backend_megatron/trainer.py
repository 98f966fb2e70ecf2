"""The Megatron trainer the loop talks to (``miles_core.contracts.Trainer``), for any layout.

One rank (tensor, pipeline and data parallel all 1) runs in this process on a real one-rank
process group; more ranks are spawned worker processes (:mod:`miles_trainer_common.processes`).
The API is the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from miles_trainer_common.batch import pack, token_batch
from miles_trainer_common.processes import ProcessWorkers
from torch import Tensor

from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.worker import RankWorker, check_needs
from miles_core.contracts import AlgorithmImpl
from miles_core.data import Group


class MegatronTrainer:
    """A Hugging Face Llama/Qwen3 checkpoint trained as a Megatron-core ``GPTModel`` (see the
    package README).

    Attributes:
        weight_version: incremented by every :meth:`train_step` (restored by :meth:`load`).
        extra: an opaque dict saved with every checkpoint and restored by :meth:`load`.
    """

    def __init__(self, options: MegatronOptions) -> None:
        self.options = options
        self.weight_version = 0
        self.extra: dict[str, Any] = {}
        self._local: RankWorker | None = None
        self._workers: ProcessWorkers | None = None

    def _call(self, method: str, *args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        if self._workers is not None:
            return self._workers.call(method, *args)[0]
        raise RuntimeError("the megatron trainer is not set up: call setup(model_path) first")

    def close(self) -> None:
        """Stop the worker processes (more than one rank); the trainer cannot be used after."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        self._local = None

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self, model_path: str) -> None:
        """Check the layout against the model's config, then build and load every rank's part
        of the model and its AdamW."""
        from miles_backend_megatron.plugin import check_model

        if self._local is not None or self._workers is not None:
            raise RuntimeError("the megatron trainer is already set up")
        # Refused here, before any process starts or any weight is read.
        check_model(model_path, self.options)
        if self.options.world_size == 1:
            local = RankWorker(self.options, 0, 1)
            local.setup(model_path)
            self._local = local
        else:
            workers = ProcessWorkers(
                self.options, worker="miles_backend_megatron.worker:RankWorker", name="megatron"
            )
            try:
                workers.call("setup", model_path)
            except BaseException:
                workers.close(graceful=False)
                raise
            self._workers = workers
            weakref.finalize(self, workers.close, False)

    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]:
        """Log-probs and entropies ``[B, T]`` of the response tokens (teacher forcing, no
        grad), samples in group order, on CPU; 0 on padding."""
        pack(groups)
        lp, ent = self._call("compute_logprobs", groups)
        return lp, ent

    def train_step(self, groups: list[Group], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One optimizer step on ``groups`` with ``algorithm``'s advantages and loss."""
        check_needs(algorithm)
        token_batch(pack(groups))
        metrics: dict[str, float] = self._call("train_step", groups, algorithm)
        self.weight_version += 1
        metrics["weight_version"] = float(self.weight_version)
        return metrics

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Every (Hugging Face name, whole tensor), one at a time, tensor-parallel parts
        gathered a decoder layer at a time."""
        if self._local is not None:
            return self._local.export_tensors()
        if self._workers is not None:
            return self._workers.export()
        raise RuntimeError("the megatron trainer is not set up: call setup(model_path) first")

    def fingerprint(self) -> dict[str, str]:
        """sha256 of the whole weights and of every rank's optimizer state."""
        result: dict[str, str] = self._call("fingerprint")
        return result

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Save every rank's model part, optimizer and RNG states, the schedule, step, weight
        version and :attr:`extra` under the folder ``path``."""
        if extra is not None:
            self.extra = dict(extra)
        self._call("save", path, self.extra, self.weight_version)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save` with the same layout (after
        :meth:`setup`); the next step is bitwise the one the saved trainer would have taken."""
        extra, version = self._call("load", path)
        self.extra = extra
        self.weight_version = version

    def sleep(self) -> None:
        """Free gradients and, on a GPU, move parameters and optimizer state to the CPU."""
        self._call("sleep")

    def wake(self) -> None:
        """Bring back what :meth:`sleep` moved."""
        self._call("wake")


def build(options: MegatronOptions | None = None) -> MegatronTrainer:
    """Factory of the ``megatron`` trainer backend."""
    return MegatronTrainer(options if options is not None else MegatronOptions())
