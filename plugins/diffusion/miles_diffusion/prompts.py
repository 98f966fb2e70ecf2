"""The ``digit_prompts`` data source: prompt records ``{"label", "seed", "prompt"}`` for the
digits model.

Each epoch holds ``size`` records with every class equally often (to within one), in an order
and with sampling seeds drawn from an RNG seeded by ``(seed, epoch)`` alone. So a source with
its own ``seed`` is a fixed held-out set: the ``diffusion_sample`` rollout function draws an
image's noise from the record's ``seed``, and the same prompts are sampled from the same noise
before and after training. ``prompt`` is the record in words (``"digit 3"``), for logs and
for the core's prompt-record contract; the policy reads ``label``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from miles_diffusion.options import DigitPromptsOptions

#: sampling seeds are drawn from [0, SEED_RANGE)
SEED_RANGE = 2**31


class DigitPrompts:
    """Endless (or ``epochs``-long) stream of digit prompt records, resumable from its
    position (``epoch``, ``index``)."""

    def __init__(self, options: DigitPromptsOptions | None = None) -> None:
        self.options = options or DigitPromptsOptions()
        self.epoch = 0
        self.index = 0
        #: no record is ever malformed; kept for the PromptSource contract
        self.skipped = 0
        self._cached: tuple[int, list[dict[str, Any]]] | None = None

    def records(self, epoch: int) -> list[dict[str, Any]]:
        """The records of ``epoch``, a function of ``(seed, epoch)`` and the options only."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        o = self.options
        rng = random.Random(f"digit_prompts:{o.seed}:{epoch}")
        labels = [o.classes[i % len(o.classes)] for i in range(o.size)]
        rng.shuffle(labels)
        seeds = rng.sample(range(SEED_RANGE), o.size)
        out = [
            {"prompt": f"digit {label}", "label": label, "seed": seed}
            for label, seed in zip(labels, seeds, strict=True)
        ]
        self._cached = (epoch, out)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.options.epochs is None or self.epoch < self.options.epochs:
            records = self.records(self.epoch)
            while self.index < len(records):
                record = records[self.index]
                self.index += 1
                yield dict(record)
            self.epoch += 1
            self.index = 0

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, saved in checkpoints."""
        return {"epoch": self.epoch, "index": self.index, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
