"""The data model: a :class:`Sample` is one trajectory, a :class:`Group` the samples of one prompt.

Plain dataclasses of Python lists, so the core stays torch-free; backends turn them into tensors.
"""

from __future__ import annotations

import array
import base64
import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Finish reasons an engine reports; ``abort`` and ``error`` make a group unusable.
FINISH_REASONS = ("stop", "length", "abort", "error")

_group_ids = itertools.count()
_next_free = 0


def new_group_id() -> int:
    """A group id no group of this process (or of the run it resumed) has had."""
    global _next_free
    gid = max(next(_group_ids), _next_free)
    _next_free = gid + 1
    return gid


def next_free_group_id() -> int:
    """The id the next group will get at the earliest (checkpoints save it, so a resumed run
    numbers its groups exactly as the uninterrupted run did)."""
    return _next_free


def reserve_group_ids(next_id: int) -> None:
    """Make every group created from now on get an id of at least ``next_id`` (a resumed run's
    ledger already holds the ids before it)."""
    global _next_free
    _next_free = max(_next_free, next_id)


def parse_version(value: Any, default: int) -> int:
    """A weight version an engine reported, as an int; ``default`` when it reported none or
    one that is not a number (SGLang's version is a free-form string, null by default)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class RoutedExperts:
    """The routing record of one sequence: for each forwarded position, the top-k expert ids
    the engine chose in every layer (SGLang's ``routed_experts``, ``-1`` in dense layers).

    Kept as bytes, not nested lists: one signed byte per id when every id fits (fewer than
    128 experts), else two, little-endian, row-major ``[positions, width]`` with ``width`` =
    layers x k. The core does not know the layer count or ``k`` of a model: a trainer that
    replays the record splits ``width`` with its model's config. A record of 100 positions x
    24 layers x top-8 is 19 KB here; as Python lists of ints it would be ~150 KB of pointers
    plus the ints, and slow to pickle to the trainer's ranks.

    Attributes:
        positions: forwarded positions (rows): prompt + response - 1 for a whole sample (the
            last token is never forwarded).
        width: ids per position (layers x k).
        itemsize: bytes per id, 1 or 2.
        data: the ids.
    """

    positions: int
    width: int
    itemsize: int
    data: bytes

    def __post_init__(self) -> None:
        if self.itemsize not in (1, 2):
            raise ValueError(f"RoutedExperts.itemsize {self.itemsize} is not 1 or 2")
        if len(self.data) != self.positions * self.width * self.itemsize:
            raise ValueError(
                f"RoutedExperts: {len(self.data)} bytes are not {self.positions} positions x "
                f"{self.width} ids x {self.itemsize} bytes"
            )

    @classmethod
    def from_ids(cls, ids: Sequence[int], positions: int) -> RoutedExperts:
        """A record of the flat ids ``[positions, width]`` (any int sequence, or an array)."""
        if positions <= 0:
            return cls(0, 0, 1, b"")
        if len(ids) % positions:
            raise ValueError(f"routed_experts: {len(ids)} ids do not split into {positions} rows")
        top = max(ids, default=0)
        if top > 32767:
            raise ValueError(f"routed_experts: expert id {top} does not fit in 16 bits")
        code = "b" if top < 128 else "h"
        packed = array.array(code, ids)
        if sys.byteorder != "little":
            packed.byteswap()
        return cls(positions, len(ids) // positions, packed.itemsize, packed.tobytes())

    @classmethod
    def from_sglang(cls, payload: str, positions: int) -> RoutedExperts:
        """SGLang's ``meta_info["routed_experts"]``: base64 of little-endian int32
        ``[positions, layers, k]``."""
        flat = array.array("i", base64.b64decode(payload))
        if sys.byteorder != "little":
            flat.byteswap()
        return cls.from_ids(flat, positions)

    def ids(self) -> array.array[int]:
        """The flat ids ``[positions * width]`` as a native-order int array."""
        out = array.array("b" if self.itemsize == 1 else "h", self.data)
        if sys.byteorder != "little":
            out.byteswap()
        return out

    def rows(self) -> list[list[int]]:
        """The ids as one list of ``width`` ints per position (for tests and inspection)."""
        flat = self.ids().tolist()
        return [flat[i * self.width : (i + 1) * self.width] for i in range(self.positions)]

    def head(self, positions: int) -> RoutedExperts:
        """The first ``positions`` rows."""
        n = max(0, min(positions, self.positions))
        return RoutedExperts(
            n, self.width, self.itemsize, self.data[: n * self.width * self.itemsize]
        )

    def extend(self, later: RoutedExperts) -> RoutedExperts:
        """This record, followed by the rows of ``later`` beyond it: ``later`` is the record
        of a request that forwarded this one's positions again (the next turn of a
        conversation, a retracted request continued), and the rows kept for those positions
        are this one's, which produced the tokens already there."""
        if self.positions == 0:
            return later
        if later.positions <= self.positions:
            return self
        if later.width != self.width:
            raise ValueError(
                f"routed_experts: a record of {later.width} ids per position continues one of "
                f"{self.width}"
            )
        if later.itemsize == self.itemsize:
            tail = later.data[self.positions * self.width * later.itemsize :]
            return RoutedExperts(later.positions, self.width, self.itemsize, self.data + tail)
        start = self.positions * self.width
        return RoutedExperts.from_ids(
            self.ids().tolist() + later.ids().tolist()[start:], later.positions
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the ids."""
        return len(self.data)


class Prompt(dict[str, Any]):
    """A data source's record with the adapter it is generated and trained for (a run that
    trains several adapters; ``None``: the run's one policy). It is the record itself to a
    rollout function and a reward; the adapter stays with it when its group is retried."""

    def __init__(self, record: Mapping[str, Any], adapter: str | None = None) -> None:
        super().__init__(record)
        self.adapter = adapter


@dataclass
class Sample:
    """One trajectory: the prompt, the generated tokens and everything the trainer needs of them.

    Attributes:
        prompt_ids: tokens of the prompt, exactly as sent to the engine.
        response_ids: every token after the prompt (generated tokens and, in multi-turn
            sessions, tokens of appended tool/user turns).
        loss_mask: one entry per response token; 1 where it is trained on (the policy generated
            it, or it is an assistant token of a conversation from data, for SFT), 0 for
            appended environment tokens.
        logprobs: the engine's log-probability of each response token (0.0 where masked, and
            on tokens no engine generated).
        versions: the weight version that produced each response token (-1 where masked, and
            on trained tokens that come from data: no policy produced them, so they are never
            stale); a multi-turn trajectory can span weight updates.
        routed_experts: the engine's routing record of the whole sequence (a run with
            ``rollout.routing`` set, on an MoE model): the experts every layer chose at every
            position the trainer forwards, ``prompt + response - 1`` of them, the prompt's
            included (see :class:`RoutedExperts`); ``None`` when not recorded.
        teacher_logprobs: a teacher model's log-probability of each response token, scored by
            the teacher's engine (on-policy distillation); ``None`` when the run has no teacher.
        trainer_logprobs: the trainer's log-probability of each response token, as the train
            step that trained on the sample computed it before its update (the behaviour
            log-probs the train-rollout mismatch is measured with), set by the trainer
            backend; ``None`` before it is trained (or with a backend that does not report it).
        trainer_expert_agreement: with ``rollout.routing`` (an MoE model), for each response
            token the fraction of MoE layers whose expert set, in the engine's routing record,
            is the trainer's own top-k at the position that predicts the token, as the same
            forward as ``trainer_logprobs`` routed it (what the agreement would be without
            replay; ``None`` for a token without a record), set by the trainer backend;
            ``None`` before it is trained, without routing, or with a backend that does not
            report it.
        reward: the scalar reward, once scored: the episode's.
        turn_rewards: a reward for each generated turn (each run of trained tokens, in order),
            set by a reward function that scores turns, in addition to ``reward`` (which the
            episode earns at its end); an algorithm that uses them gives each turn's tokens
            the return from that turn on. ``None`` (the default): the episode's reward only.
        finish_reason: one of ``FINISH_REASONS``.
        metadata: anything else (the prompt record, the reward's details, errors).
        sampling_params: what the engine drew the response with, in SGLang's names
            (``temperature``, ``top_p``, ``top_k``), recorded by the rollout function; with
            ``top_p < 1`` or ``top_k`` the engine's log-probs are the truncated distribution's,
            and the trainer applies the same truncation. ``None``: the whole vocabulary's.
        counts: events the rollout counted in this sample, by name (the session server's
            ``malformed_tool_calls``, ...); each step's metrics sum them over the groups it
            trained on as ``counts/<name>``.
        adapter: the served name of the adapter that generated it and that trains on it (a
            run that trains adapters; ``None`` when the run trains the whole model).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: RoutedExperts | None = None
    teacher_logprobs: list[float] | None = None
    trainer_logprobs: list[float] | None = None
    trainer_expert_agreement: list[float | None] | None = None
    reward: float | None = None
    turn_rewards: list[float] | None = None
    finish_reason: str = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling_params: dict[str, float] | None = None
    counts: dict[str, float] = field(default_factory=dict)
    adapter: str | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}"
            )

    def append(
        self,
        token_ids: list[int],
        *,
        logprobs: list[float] | None = None,
        version: int | None = None,
        trained: bool = True,
        routed_experts: RoutedExperts | None = None,
    ) -> None:
        """Append response tokens: generated ones (``trained=True``, with log-probs and the weight
        version) or environment ones (``trained=False``). ``routed_experts``: the record of the
        request that generated them, which covers the whole sequence up to them; its rows
        beyond the sample's record are added (:meth:`RoutedExperts.extend`)."""
        n = len(token_ids)
        if trained:
            if logprobs is None or version is None or len(logprobs) != n:
                raise ValueError("generated tokens need one log-prob each and a weight version")
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([1 if trained else 0] * n)
        self.logprobs.extend(logprobs if trained and logprobs is not None else [0.0] * n)
        self.versions.extend([version if trained and version is not None else -1] * n)
        if routed_experts is not None:
            if self.routed_experts is None:
                self.routed_experts = routed_experts
            else:
                self.routed_experts = self.routed_experts.extend(routed_experts)

    @property
    def failed(self) -> bool:
        """True when generation was aborted or errored: the group cannot be trained on."""
        return self.finish_reason in ("abort", "error")

    @property
    def oldest_version(self) -> int | None:
        """Smallest weight version among generated tokens, ``None`` if none was generated
        (trained tokens from data have version -1 and do not count)."""
        generated = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m and v >= 0]
        return min(generated) if generated else None

    def check(self) -> None:
        """Raise ``ValueError`` if the per-token lists disagree in length."""
        n = len(self.response_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"sample.{name} has {len(getattr(self, name))} entries, expected {n}"
                )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(
                f"sample.teacher_logprobs has {len(self.teacher_logprobs)} entries, expected {n}"
            )
        if self.turn_rewards is not None and len(self.turn_rewards) != len(self.turns()):
            raise ValueError(
                f"sample.turn_rewards has {len(self.turn_rewards)} values for "
                f"{len(self.turns())} generated turns (runs of trained tokens)"
            )
        routed = self.routed_experts
        forwarded = len(self.prompt_ids) + n - 1
        if routed is not None and routed.positions != forwarded:
            raise ValueError(
                f"sample.routed_experts covers {routed.positions} positions, expected "
                f"{forwarded} (prompt + response - 1)"
            )

    def turns(self) -> list[tuple[int, int]]:
        """The generated turns: ``(start, end)`` of each run of trained tokens of the
        response, in order (what ``turn_rewards`` scores one by one)."""
        out: list[tuple[int, int]] = []
        start: int | None = None
        for i, trained in enumerate([*self.loss_mask, 0]):
            if trained and start is None:
                start = i
            elif not trained and start is not None:
                out.append((start, i))
                start = None
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (a routing record as its fields, the ids in base64)."""
        out = asdict(self)
        if self.routed_experts is not None:
            out["routed_experts"]["data"] = base64.b64encode(self.routed_experts.data).decode()
        return out


@dataclass
class Group:
    """The samples of one prompt: generated, scored, kept or dropped together. ``adapter``:
    the served name of the adapter the group belongs to (its samples'; ``None`` when the run
    trains the whole model): a run that trains several adapters generates each group with its
    adapter and trains that adapter alone on it."""

    samples: list[Sample]
    prompt: dict[str, Any] = field(default_factory=dict)
    group_id: int = field(default_factory=new_group_id)
    adapter: str | None = None

    @property
    def oldest_version(self) -> int | None:
        """Minimum weight version over every generated token of every sample (pessimistic)."""
        versions = [v for s in self.samples if (v := s.oldest_version) is not None]
        return min(versions) if versions else None

    def staleness(self, current_version: int) -> int:
        """Trainer version minus the group's oldest version (0 when nothing was generated)."""
        oldest = self.oldest_version
        return 0 if oldest is None else current_version - oldest

    @property
    def failed(self) -> bool:
        """True when any sample was aborted or errored."""
        return any(s.failed for s in self.samples)

    @property
    def rewards(self) -> list[float | None]:
        """The samples' rewards, in order."""
        return [s.reward for s in self.samples]

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the policy generated across the group."""
        return sum(sum(s.loss_mask) for s in self.samples)
