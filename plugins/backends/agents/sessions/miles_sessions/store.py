"""Sessions: the stored turns of a conversation, their exact tokens, and its training samples.

A session is a tree of turns. Each turn holds the tokens a request appended (rendered messages:
not trained) and the tokens the engine generated for the reply (trained), with their log-probs,
weight version and, when the engine returns them, routed experts. The engine's input for a new
turn is always the stored tokens of the path to it plus the appended tokens, so a training
sequence is exactly what the engine saw and generated.

* **linear**: one path; a request must extend the stored conversation, or retry its last turn
  (its messages stop before the last reply), which replaces that turn.
* **branching**: append-only; a request that diverges from the stored conversation starts a
  branch at the divergence; every leaf is one training sequence sharing its prefix's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_core.data import RoutedExperts, Sample
from miles_sessions.appender import Appender, NotAppendOnly, TurnText
from miles_sessions.toolcalls import malformed

log = logging.getLogger("miles_sessions")

Message = dict[str, Any]
Mode = Literal["linear", "branching"]


class SessionError(Exception):
    """A request the session refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def message_key(msg: Mapping[str, Any], *, normalize: bool = True) -> tuple[Any, ...]:
    """What identifies a message when a client sends the history back: role, content and tool
    calls (name and arguments; with ``normalize``, arguments compare as parsed JSON). Ids,
    reasoning and extra fields a client may drop or rewrite are not part of it; the stored
    version of a matched message is what counts."""
    calls = tuple(
        (
            c["function"]["name"],
            json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True)
            if normalize
            else c["function"]["arguments"],
        )
        for c in msg.get("tool_calls") or ()
    )
    return (msg["role"], msg.get("content") or "", calls)


@dataclass
class Turn:
    """One turn: appended messages and their tokens, then the generated reply and its tokens.

    The root of a session is a turn with no messages and no tokens.
    """

    index: int
    parent: Turn | None
    new_messages: list[Message] = field(default_factory=list)
    reply: Message | None = None
    #: The whole canonical conversation at the end of this turn.
    messages: list[Message] = field(default_factory=list)
    env_ids: list[int] = field(default_factory=list)
    gen_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: str = ""
    #: the routing record of the turn's request (every position of the context it was sent and
    #: of its reply but the last), when the engine returned one
    routed_experts: RoutedExperts | None = None
    finish_reason: str = "stop"
    #: what the engine drew the reply with (temperature, top_p, top_k)
    sampling: dict[str, Any] = field(default_factory=dict)
    #: whether the turn's stored tokens are canonical: its generated text is the render of the
    #: parsed reply, and no token merges across its joins (``merged``)
    canonical: bool = True
    difference: str = ""
    #: where the turn's tokens merge across a join with the tokens before or after them (the
    #: appended text and the reply, or the previous reply and the appended text); "" if nowhere
    merged: str = ""
    #: the generated text (the decoded ``gen_ids``), for the next turn's join
    gen_text: str = ""
    #: the reply's malformed tool calls (see :mod:`miles_sessions.toolcalls`)
    tool_call_errors: list[dict[str, Any]] = field(default_factory=list)
    #: Text the template writes after the generated tokens (appended with the next request).
    closing: str = ""
    children: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    #: :func:`message_key` of ``new_messages`` and the reply, computed once.
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    #: The next request's render window and its render (see :meth:`Appender.append`).
    window: tuple[list[Message], str] | None = None

    def path(self) -> list[Turn]:
        """Turns from the first one to this one (the root excluded)."""
        out: list[Turn] = []
        node: Turn | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def token_ids(self) -> list[int]:
        """Every stored token from the start of the conversation to the end of this turn."""
        ids: list[int] = []
        for t in self.path():
            ids.extend(t.env_ids)
            ids.extend(t.gen_ids)
        return ids


@dataclass
class Pending:
    """A request located in the tree, tokenized, not yet generated."""

    base: Turn
    new: list[Message]
    turn: TurnText
    input_ids: list[int]
    tools: list[dict[str, Any]] | None


def _version(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        return -1


class Session:
    """One conversation's stored turns (see the module docstring)."""

    def __init__(self, session_id: str, mode: Mode, appender: Appender) -> None:
        self.id = session_id
        self.mode = mode
        self.appender = appender
        self.family = appender.family
        self.root = Turn(0, None)
        self.tip = self.root
        self.tools: list[dict[str, Any]] | None = None
        self.lock = asyncio.Lock()
        self.created = time.time()
        self.rollbacks = 0
        #: the engine generating this session's turns (None: its server's)
        self.engine: Any = None
        #: the temperature, top_p and top_k a request leaves out (a rollout sets the run's)
        self.sampling: dict[str, Any] = {}
        self._ids = itertools.count(1)

    # --- locating a request ----------------------------------------------------------------

    def locate(self, messages: Sequence[Message]) -> tuple[Turn, list[Message]]:
        """The deepest stored turn whose conversation is a prefix of ``messages``, and the
        messages after it."""
        # Raw keys first (a client usually echoes what it got); on a mismatch, compare again
        # with tool-call arguments parsed (a client may re-serialise them).
        keys = [message_key(m, normalize=False) for m in messages]
        node, at = self.root, 0
        while True:
            for child in node.children:
                end = at + len(child.keys)
                if end <= len(keys) and (
                    keys[at:end] == child.keys
                    or [message_key(m) for m in messages[at:end]]
                    == [message_key(m) for m in [*child.new_messages, child.reply or {}]]
                ):
                    node, at = child, end
                    break
            else:
                return node, list(messages[at:])

    def prepare(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> Pending:
        """Locate and tokenize a request; raises :class:`SessionError` when it is refused."""
        if not messages:
            raise SessionError(400, "messages must not be empty")
        if self.root.children and tools != self.tools:
            raise SessionError(
                409,
                "the tools differ from those of the session's first request; a session's "
                "tools are fixed (they are rendered before every message)",
            )
        base, new = self.locate(messages)
        if not new:
            raise SessionError(
                400,
                "the request appends no message after the stored conversation (its last "
                "message is the stored assistant reply); add a user or tool message",
            )
        if self.mode == "linear" and base is not self.tip and base is not self.tip.parent:
            stored = len(self.tip.messages)
            raise SessionError(
                409,
                f"linear session {self.id}: the request diverges from the stored conversation "
                f"after message {len(base.messages)} (of {stored} stored); a linear session "
                "may only extend its conversation or retry its last turn. Create the session "
                "with mode='branching' to fork earlier turns.",
            )
        for i, m in enumerate(new):
            if m["role"] not in self.family.roles:
                raise SessionError(
                    400,
                    f"messages[{len(messages) - len(new) + i}].role {m['role']!r} is not "
                    f"rendered by family {self.family.name!r} (roles: "
                    f"{', '.join(self.family.roles)})",
                )
        try:
            turn = self.appender.append(
                base.messages, new, tools, closing=base.closing, cached=base.window
            )
        except NotAppendOnly as exc:
            raise SessionError(409, str(exc)) from exc
        except Exception as exc:  # a template refusing a conversation shape is bad input
            raise SessionError(
                400, f"the family's template cannot render these messages: {exc}"
            ) from exc
        return Pending(base, new, turn, base.token_ids() + turn.ids, tools)

    # --- storing a generated turn ------------------------------------------------------------

    def commit(
        self,
        pending: Pending,
        *,
        output_ids: list[int],
        logprobs: list[float],
        finish_reason: str,
        weight_version: str,
        routed_experts: RoutedExperts | str | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> Turn:
        """Store a generated reply after ``pending``; returns the new turn (its ``reply`` is the
        parsed assistant message). ``routed_experts``: the engine's routing record of the
        request (decoded, or SGLang's base64 ``meta_info["routed_experts"]``), which covers
        ``len(pending.input_ids) + len(output_ids) - 1`` positions."""
        experts = self._checked_output(pending, output_ids, logprobs, routed_experts)
        index = next(self._ids)
        text = self.family.decode(output_ids)
        reply, errors = self._reply(index, text, pending.tools)
        stopped = (
            finish_reason == "stop"
            and bool(output_ids)
            and output_ids[-1] in self.family.stop_token_ids
        )
        end = self.appender.turn_end(pending.turn, reply, text, stopped)
        base = pending.base
        merged = self.appender.joins(base.gen_text, pending.turn.text, text)
        turn = Turn(
            index,
            base,
            new_messages=pending.new,
            reply=reply,
            messages=base.messages + pending.new + [reply],
            env_ids=pending.turn.ids,
            gen_ids=list(output_ids),
            logprobs=list(logprobs),
            weight_version=weight_version,
            routed_experts=experts,
            finish_reason=finish_reason if finish_reason in ("stop", "length") else "abort",
            sampling=dict(sampling or {}),
            canonical=end.canonical and not merged,
            difference="; ".join(d for d in (end.difference, merged) if d),
            merged=merged,
            gen_text=text,
            tool_call_errors=errors,
            closing=end.closing,
            keys=[message_key(m, normalize=False) for m in [*pending.new, reply]],
            window=(end.window, end.window_render) if end.window is not None else None,
        )
        if not end.canonical:
            log.warning(
                "session %s turn %d: the generated tokens are not the canonical render of the "
                "parsed reply (kept as generated; the next turn's context continues from "
                "them):\n    %s",
                self.id,
                index,
                end.difference,
            )
        if merged:
            log.warning("session %s turn %d: tokens merge at a join: %s", self.id, index, merged)
        self._attach(turn, pending)
        return turn

    @staticmethod
    def _checked_output(
        pending: Pending,
        output_ids: list[int],
        logprobs: list[float],
        routed_experts: RoutedExperts | str | None,
    ) -> RoutedExperts | None:
        """The engine's routing record, decoded; a :class:`SessionError` (502) when the engine's
        answer does not describe the turn (log-probs or routed positions of another length)."""
        if len(logprobs) != len(output_ids):
            raise SessionError(
                502,
                f"the engine returned {len(output_ids)} tokens but {len(logprobs)} log-probs",
            )
        forwarded = len(pending.input_ids) + len(output_ids) - 1
        if isinstance(routed_experts, str):
            try:
                routed_experts = RoutedExperts.from_sglang(routed_experts, forwarded)
            except ValueError as exc:
                raise SessionError(
                    502, f"the engine's routed_experts cover no {forwarded} positions: {exc}"
                ) from exc
        if routed_experts is not None and routed_experts.positions != forwarded:
            raise SessionError(
                502,
                f"the engine's routed_experts cover {routed_experts.positions} positions, and "
                f"the turn forwarded {forwarded} (prompt + output - 1)",
            )
        return routed_experts

    def _reply(
        self, index: int, text: str, tools: list[dict[str, Any]] | None
    ) -> tuple[Message, list[dict[str, Any]]]:
        """The assistant message the family parses from the generated ``text`` of turn
        ``index`` (tool calls get ids unique in the session), and its malformed tool calls
        (``tools``: those offered)."""
        parsed = self.family.parse_assistant(text)
        reply: Message = {"role": "assistant", "content": parsed.get("content") or ""}
        if parsed.get("reasoning_content") is not None:
            reply["reasoning_content"] = parsed["reasoning_content"]
        if parsed.get("tool_calls"):
            reply["tool_calls"] = [
                {
                    "id": f"call_{index}_{i}",
                    "type": "function",
                    "function": dict(c["function"]),
                }
                for i, c in enumerate(parsed["tool_calls"])
            ]
        errors = malformed(
            reply.get("tool_calls") or (), parsed.get("tool_call_errors") or (), tools
        )
        if errors:
            log.info("session %s turn %d: malformed tool calls: %s", self.id, index, errors)
        return reply, errors

    def _attach(self, turn: Turn, pending: Pending) -> None:
        """Put ``turn`` in the tree under its base and make it the tip (a linear session's
        retry of its last turn replaces that turn)."""
        base = pending.base
        if self.mode == "linear" and base is not self.tip:
            base.children.clear()  # retry of the last turn: it is rolled back
            self.rollbacks += 1
        base.children.append(turn)
        if not self.root.children or self.tools is None:
            self.tools = pending.tools
        self.tip = turn

    # --- training samples ----------------------------------------------------------------------

    def leaves(self) -> list[Turn]:
        """The last turn of every branch (of the one path, in a linear session)."""
        if self.mode == "linear":
            return [self.tip] if self.tip is not self.root else []
        out: list[Turn] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(reversed(node.children))
            elif node is not self.root:
                out.append(node)
        return out

    def sample(self, leaf: Turn) -> Sample:
        """The training sample of the path ending at ``leaf``."""
        path = leaf.path()
        # A routing record is the whole path's only when every turn returned one: each turn's
        # record adds the positions it forwarded first (its appended tokens and its reply).
        with_experts = all(t.routed_experts is not None for t in path)
        first = path[0]
        sample = Sample(prompt_ids=list(first.env_ids))
        for t in path:
            if t is not first:
                sample.append(list(t.env_ids), trained=False)
            sample.append(
                list(t.gen_ids),
                logprobs=list(t.logprobs),
                version=_version(t.weight_version),
                trained=True,
                routed_experts=t.routed_experts if with_experts else None,
            )
        sample.finish_reason = leaf.finish_reason
        sample.sampling_params, error = sample_draw([t.sampling for t in path])
        if error:
            sample.finish_reason = "error"
        sample.metadata = {
            "session_id": self.id,
            "leaf_turn": leaf.index,
            "turns": [t.index for t in path],
            "non_canonical_turns": [t.index for t in path if not t.canonical],
            "merged_boundaries": [t.index for t in path if t.merged],
            "malformed_tool_calls": sum(len(t.tool_call_errors) for t in path),
            "weight_versions": [t.weight_version for t in path],
            "family": self.family.name,
            "messages": leaf.messages,
        }
        if error:
            sample.metadata["error"] = error
        sample.counts = _counts(path)
        sample.check()
        return sample

    def samples(self) -> list[Sample]:
        """One training sample per kept branch (one in a linear session)."""
        return [self.sample(leaf) for leaf in self.leaves()]

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary."""
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node is not self.root:
                nodes.append(node)
        return {
            "id": self.id,
            "mode": self.mode,
            "family": self.family.name,
            "turns": len(nodes),
            "branches": len(self.leaves()),
            "tip_turn": self.tip.index,
            "tip_tokens": len(self.tip.token_ids()),
            "rollbacks": self.rollbacks,
            **{name: int(n) for name, n in _counts(nodes).items()},
            "created": self.created,
        }


def truncates(drawn: Mapping[str, Any]) -> bool:
    """Whether a turn's draw kept fewer than all tokens (top-p below 1 or a top-k)."""
    return drawn.get("top_p", 1.0) < 1.0 or drawn.get("top_k", -1) not in (-1, 0, None)


def sample_draw(drawn: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """What a sample whose turns were drawn with ``drawn`` records, and an error: the turns'
    one draw (``None`` when they recorded none); turns that truncated differently are an error,
    since the trainer truncates a sample one way."""
    if all(d == drawn[0] for d in drawn):
        return (dict(drawn[0]) or None), ""
    if any(truncates(d) for d in drawn):
        return None, (
            f"the session's turns were drawn with different truncations {list(drawn)}; a "
            "sample is trained with one (Sample.sampling_params)"
        )
    return None, ""


def _counts(turns: list[Turn]) -> dict[str, float]:
    """What ``turns`` count: malformed tool calls, turns whose tokens are not the canonical
    ones, and merged boundaries (a sample's are summed per step as ``counts/<name>``)."""
    return {
        "malformed_tool_calls": float(sum(len(t.tool_call_errors) for t in turns)),
        "non_canonical_turns": float(sum(not t.canonical for t in turns)),
        "merged_boundaries": float(sum(bool(t.merged) for t in turns)),
    }
