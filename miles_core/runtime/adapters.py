"""A run that trains several adapters on one base (the config's ``adapters``): each adapter's
prompts from its own data source, taken in turn, and its outputs in its own folder."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles_core.data import Prompt


class AdapterPrompts:
    """The run's prompt source when it trains several adapters: one prompt of each adapter's
    source in turn (round robin, in the config's order), each a :class:`Prompt` naming its
    adapter. A source that runs out leaves the others to go on; the run's prompts run out with
    the last. Resumable: the turn and every source's position are its state."""

    def __init__(self, sources: dict[str, Any]) -> None:
        self.sources = sources
        self.names = list(sources)
        #: how many prompts were taken (whose adapter is next)
        self.turn = 0
        self.exhausted: set[str] = set()

    @property
    def skipped(self) -> int:
        """Malformed rows every source skipped."""
        return sum(int(s.skipped) for s in self.sources.values())

    def __iter__(self) -> Iterator[Prompt]:
        streams = {n: iter(s) for n, s in self.sources.items() if n not in self.exhausted}
        while streams:
            name = self.names[self.turn % len(self.names)]
            self.turn += 1
            stream = streams.get(name)
            if stream is None:
                continue
            try:
                record = next(stream)
            except StopIteration:
                del streams[name]
                self.exhausted.add(name)
                continue
            yield Prompt(record, adapter=name)

    def state_dict(self) -> dict[str, Any]:
        """The turn, the sources that ran out and each source's own state."""
        return {
            "turn": self.turn,
            "exhausted": sorted(self.exhausted),
            "sources": {n: s.state_dict() for n, s in self.sources.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same adapters, by name)."""
        saved = set(state["sources"])
        if saved != set(self.sources):
            raise ValueError(
                f"the checkpoint's adapters {sorted(saved)} are not this run's "
                f"{sorted(self.sources)}: a run resumes with the adapters it was saved with"
            )
        self.turn = int(state["turn"])
        self.exhausted = set(state["exhausted"])
        for name, source in self.sources.items():
            source.load_state_dict(state["sources"][name])
