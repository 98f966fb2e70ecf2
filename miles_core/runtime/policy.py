"""The trainer as the run uses it: colocated turn-taking (sleep while the engines generate,
wake to train, save or export), and its weights for the fleet to publish."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from miles_core.contracts import AdapterTrainer, Trainer


class Policy:
    """Wraps the run's :class:`~miles_core.contracts.Trainer`; tracks whether it sleeps."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.asleep = False

    def set_awake(self, awake: bool) -> None:
        """Wake the trainer or put it to sleep (no-op when it already is)."""
        if awake and self.asleep:
            self.trainer.wake()
        elif not awake and not self.asleep:
            self.trainer.sleep()
        self.asleep = not awake

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The trainer awake for the block, asleep again after it if it slept before."""
        was_asleep = self.asleep
        self.set_awake(True)
        try:
            yield
        finally:
            self.set_awake(not was_asleep)

    @contextmanager
    def weights(self, adapter: str | None = None) -> Iterator[Iterable[tuple[str, Any]]]:
        """The trainer's weights in the engine's naming, streamed while the block runs; with
        ``adapter`` (a run that trains several), that adapter's alone."""
        with self.awake():
            if adapter is None:
                yield self.trainer.export_weights()
            else:
                yield cast(AdapterTrainer, self.trainer).export_weights(adapter)

    @contextmanager
    def model_weights(
        self, adapter: bool, name: str | None = None
    ) -> Iterator[Iterable[tuple[str, Any]]]:
        """The whole policy's weights in Hugging Face naming: :meth:`weights` without an
        adapter; with one (the run config's ``adapter``), the trainer's
        :meth:`~miles_core.contracts.AdapterTrainer.export_model` (the adapter merged in; the
        adapter ``name`` of several), since its :meth:`weights` are the adapter's alone."""
        with self.awake():
            if not adapter:
                yield self.trainer.export_weights()
            elif name is None:
                yield cast(AdapterTrainer, self.trainer).export_model()
            else:
                yield cast(AdapterTrainer, self.trainer).export_model(name)

    def save_adapter(self, path: str, name: str | None = None) -> None:
        """The trained adapter in PEFT's format under ``path`` (a run with an adapter; the
        adapter ``name`` of several)."""
        with self.awake():
            trainer = cast(AdapterTrainer, self.trainer)
            if name is None:
                trainer.save_adapter(path)
            else:
                trainer.save_adapter(path, name)

    def save(self, path: str) -> None:
        """The trainer's state (model, optimizer, RNG, step) under ``path``."""
        with self.awake():
            self.trainer.save(path)

    def load(self, path: str) -> None:
        """Restore :meth:`save`."""
        self.trainer.load(path)
