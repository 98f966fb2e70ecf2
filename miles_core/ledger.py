"""The ledger: every group produced is, at any moment, in exactly one state.

States are ``in_flight`` (being generated), ``buffered`` (complete, waiting for the trainer),
``trained`` and ``dropped`` (with a reason). Only forward transitions are allowed, and the
ledger balances by construction: produced = in flight + buffered + trained + dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

IN_FLIGHT = "in_flight"
BUFFERED = "buffered"
TRAINED = "trained"
DROPPED = "dropped"
STATES = (IN_FLIGHT, BUFFERED, TRAINED, DROPPED)


class DropReason(str, Enum):
    """Every reason a group is dropped; the ledger takes no other."""

    #: a sample's request ended with finish reason ``abort`` (a pause or abort on the engine)
    ABORTED = "aborted"
    #: a request failed on the engine, or its engine died under it
    ENGINE_FAILED = "engine_failed"
    #: its engine left the running job (drained, or lost with its node) while it generated
    ENGINE_LEFT = "engine_left"
    #: the reward function raised on a sample (the reward would be made up)
    REWARD_FAILED = "reward_failed"
    #: the teacher's engine could not score a sample (on-policy distillation), even after the
    #: engine was restarted
    TEACHER_FAILED = "teacher_failed"
    #: the rollout function itself raised (a bug: the run stops)
    ROLLOUT_FAILED = "rollout_failed"
    #: a sample filter left no sample, or a group filter rejected the group
    FILTERED = "filtered"
    #: taken by the trainer beyond the staleness bound (asynchronous schedule)
    STALE = "stale"
    #: still in flight or queued when the run ended
    RUN_ENDED = "run_ended"
    #: in flight or queued in a checkpoint the run resumed from (the process that held it died)
    INTERRUPTED = "interrupted"


_ALLOWED = {
    IN_FLIGHT: {BUFFERED, TRAINED, DROPPED},
    BUFFERED: {TRAINED, DROPPED},
    TRAINED: set(),
    DROPPED: set(),
}


class LedgerError(RuntimeError):
    """An impossible transition: a bug in the loop, never swallowed."""


@dataclass
class Ledger:
    """Tracks the state of every group id produced during a run."""

    _state: dict[int, str] = field(default_factory=dict)
    _reason: dict[int, str] = field(default_factory=dict)
    #: the adapter of each group of a run that trains adapters (its served name)
    _adapter: dict[int, str] = field(default_factory=dict)

    def start(self, group_id: int, adapter: str | None = None) -> None:
        """Record a new group as in flight (of ``adapter``, when the run trains adapters)."""
        if group_id in self._state:
            raise LedgerError(f"group {group_id} was already produced ({self._state[group_id]})")
        self._state[group_id] = IN_FLIGHT
        if adapter is not None:
            self._adapter[group_id] = adapter

    def adapter(self, group_id: int) -> str | None:
        """The adapter a group belongs to (``None``: the run trains the whole model)."""
        return self._adapter.get(group_id)

    def _move(self, group_id: int, new: str) -> None:
        old = self._state.get(group_id)
        if old is None:
            raise LedgerError(f"group {group_id} is not in the ledger")
        if new not in _ALLOWED[old]:
            raise LedgerError(f"group {group_id} cannot go from {old} to {new}")
        self._state[group_id] = new

    def buffer(self, group_id: int) -> None:
        """Mark a generated group as waiting in the buffer."""
        self._move(group_id, BUFFERED)

    def train(self, group_id: int) -> None:
        """Mark a group as consumed by a train step."""
        self._move(group_id, TRAINED)

    def drop(self, group_id: int, reason: DropReason) -> None:
        """Mark a group as dropped, with the reason it was dropped."""
        try:
            reason = DropReason(reason)
        except ValueError:
            allowed = ", ".join(r.value for r in DropReason)
            raise LedgerError(f"unknown drop reason {reason!r}; allowed: {allowed}") from None
        self._move(group_id, DROPPED)
        self._reason[group_id] = reason.value

    def state(self, group_id: int) -> str:
        """Current state of one group."""
        return self._state[group_id]

    @property
    def next_id(self) -> int:
        """One more than the largest group id the ledger has seen (0 when empty)."""
        return max(self._state, default=-1) + 1

    @property
    def produced(self) -> int:
        """Number of groups ever started."""
        return len(self._state)

    def counts(self) -> dict[str, int]:
        """Counts per state plus ``dropped.<reason>`` per reason and ``produced``; in a run
        that trains adapters, ``adapter.<name>.<state>`` and ``adapter.<name>.produced``."""
        per_state = Counter(self._state.values())
        out = {s: per_state.get(s, 0) for s in STATES}
        for reason, n in sorted(Counter(self._reason.values()).items()):
            out[f"{DROPPED}.{reason}"] = n
        out["produced"] = self.produced
        for name, mine in self.adapter_counts().items():
            out.update({f"adapter.{name}.{state}": n for state, n in mine.items()})
        return out

    def adapter_counts(self) -> dict[str, dict[str, int]]:
        """Per adapter (a run that trains several): its groups per state and ``produced``."""
        out: dict[str, dict[str, int]] = {}
        for gid, name in self._adapter.items():
            mine = out.setdefault(name, {**dict.fromkeys(STATES, 0), "produced": 0})
            mine[self._state[gid]] += 1
            mine["produced"] += 1
        return dict(sorted(out.items()))

    def check(self) -> None:
        """Raise :class:`LedgerError` unless produced = in flight + buffered + trained + dropped
        and every dropped group has a reason."""
        c = self.counts()
        total = sum(c[s] for s in STATES)
        if total != c["produced"]:
            raise LedgerError(f"ledger does not balance: {c}")
        by_reason = sum(v for k, v in c.items() if k.startswith(f"{DROPPED}."))
        if by_reason != c[DROPPED]:
            raise LedgerError(f"dropped groups without a reason: {c}")

    def state_dict(self) -> dict[str, Any]:
        """Serializable state, saved in checkpoints."""
        return {
            "state": {str(k): v for k, v in self._state.items()},
            "reason": {str(k): v for k, v in self._reason.items()},
            "adapter": {str(k): v for k, v in self._adapter.items()},
        }

    @classmethod
    def from_state_dict(cls, data: dict[str, Any]) -> Ledger:
        """Restore a ledger saved with :meth:`state_dict`."""
        ledger = cls()
        ledger._state = {int(k): v for k, v in data["state"].items()}
        ledger._reason = {int(k): v for k, v in data["reason"].items()}
        ledger._adapter = {int(k): v for k, v in data.get("adapter", {}).items()}
        unknown = set(ledger._state.values()) - set(STATES)
        if unknown:
            raise LedgerError(f"unknown ledger states {sorted(unknown)}")
        ledger.check()
        return ledger
