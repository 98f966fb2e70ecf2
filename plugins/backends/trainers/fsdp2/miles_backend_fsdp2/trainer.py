"""The FSDP2 trainer the loop talks to (``miles_core.contracts.Trainer``), for any world size.

World size 1 runs the rank in this process (a real one-rank process group); world size N
spawns N worker processes (:mod:`miles_trainer_common.processes`). The API is the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from miles_trainer_common.batch import pack, token_batch
from miles_trainer_common.processes import ProcessWorkers
from torch import Tensor

from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.worker import RankWorker, check_needs
from miles_core.contracts import AlgorithmImpl
from miles_core.data import Group


class FSDP2Trainer:
    """A Hugging Face causal LM trained with FSDP2 (see the package README).

    Attributes:
        weight_version: incremented by every :meth:`train_step` (restored by :meth:`load`).
        extra: an opaque dict saved with every checkpoint and restored by :meth:`load` (the
            loop keeps its data position and ledger there).
    """

    def __init__(self, options: FSDP2Options) -> None:
        self.options = options
        self.weight_version = 0
        self.extra: dict[str, Any] = {}
        self._local: RankWorker | None = None
        self._workers: ProcessWorkers | None = None

    # --- plumbing -------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        if self._workers is not None:
            return self._workers.call(method, *args)[0]
        raise RuntimeError("the fsdp2 trainer is not set up: call setup(model_path) first")

    def close(self) -> None:
        """Stop the worker processes (world size > 1); the trainer cannot be used after."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        self._local = None

    def __enter__(self) -> FSDP2Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the contract -----------------------------------------------------------------------

    def setup(self, model_path: str) -> None:
        """Load the Hugging Face checkpoint at ``model_path``, shard it and build AdamW."""
        if self._local is not None or self._workers is not None:
            raise RuntimeError("the fsdp2 trainer is already set up")
        if self.options.world_size == 1:
            local = RankWorker(self.options, 0, 1)
            local.setup(model_path)
            self._local = local
        else:
            workers = ProcessWorkers(
                self.options,
                worker="miles_backend_fsdp2.worker:RankWorker",
                options_cls="miles_backend_fsdp2.options:FSDP2Options",
                name="fsdp2",
            )
            try:
                workers.call("setup", model_path)
            except BaseException:
                workers.close(graceful=False)
                raise
            self._workers = workers
            # A trainer dropped without close() still stops its processes.
            weakref.finalize(self, workers.close, False)

    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]:
        """Log-probs and entropies ``[B, T]`` of the response tokens (teacher forcing, no
        grad), samples in group order, on CPU; 0 on padding."""
        pack(groups)  # malformed input is refused here, before any rank runs
        lp, ent = self._call("compute_logprobs", groups)
        return lp, ent

    def train_step(self, groups: list[Group], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One optimizer step on ``groups`` with ``algorithm``'s advantages and loss; returns
        the algorithm's metrics plus ``grad_norm``, ``lr``, ``tokens_per_s``, ``step_time_s``,
        ``micro_batches``, ``weight_version``..."""
        check_needs(algorithm)
        token_batch(pack(groups))
        metrics: dict[str, float] = self._call("train_step", groups, algorithm)
        self.weight_version += 1
        metrics["weight_version"] = float(self.weight_version)
        return metrics

    def compute_values(self, groups: list[Group]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens (beyond the contract; no
        grad, on CPU, 0 on padding); the critic is built first if no step has needed it."""
        pack(groups)
        values: Tensor = self._call("compute_values", groups)
        return values

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Every (Hugging Face state-dict name, full unsharded tensor), one at a time: the
        next tensor is gathered only when the consumer asks for it."""
        if self._local is not None:
            return self._local.export_tensors()
        if self._workers is not None:
            return self._workers.export()
        raise RuntimeError("the fsdp2 trainer is not set up: call setup(model_path) first")

    def fingerprint(self) -> dict[str, str]:
        """sha256 of the full weights (``weights``) and of the optimizer, schedule and step
        (``optimizer``), and once a critic exists of its weights (``critic``) and its
        optimizer and schedule (``critic_optimizer``): equal fingerprints mean bitwise-equal
        training state."""
        result: dict[str, str] = self._call("fingerprint")
        return result

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Save model, optimizer, LR schedule (and the critic's three when it exists), RNG
        states, step, weight version and :attr:`extra` (replaced by ``extra`` when given)
        under the folder ``path``."""
        if extra is not None:
            self.extra = dict(extra)
        self._call("save", path, self.extra, self.weight_version)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save` (after :meth:`setup`); the next step
        is bitwise the one the saved trainer would have taken."""
        extra, version = self._call("load", path)
        self.extra = extra
        self.weight_version = version

    def sleep(self) -> None:
        """Free gradients and, on a GPU, move parameters and optimizer state to the CPU."""
        self._call("sleep")

    def wake(self) -> None:
        """Bring back what :meth:`sleep` moved."""
        self._call("wake")


def build(options: FSDP2Options | None = None) -> FSDP2Trainer:
    """Factory of the ``fsdp2`` trainer backend."""
    return FSDP2Trainer(options if options is not None else FSDP2Options())
