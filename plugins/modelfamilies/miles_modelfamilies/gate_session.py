"""A linear token-in-token-out session over the engine contract: the engine gate's own
bookkeeping.

It stores what a session stores in a run: per turn, the tokens a request appended (the
rendered new messages, tokenized alone) and the tokens the engine generated, exactly; the
engine's input for the next turn is always the stored tokens plus the appended ones. What a
request appends is rendered as a session server does by default: over a *window* of the
history (the first message, then the last assistant turn on), so the gate also checks that the
family's render of that window appends the same text as the whole history (the gate's checks
compare with renders of the whole conversation).

A request that repeats the stored conversation minus its last reply **retries** the last turn:
it is rolled back and generated anew (``rollbacks``). Anything else that does not extend the
stored conversation is refused (the session is linear).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_modelfamilies.gate_engine import EngineGateError, GenerateAnswer

Message = dict[str, Any]
Generate = Callable[[list[int], dict[str, Any]], GenerateAnswer]


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def message_key(msg: Message) -> tuple[Any, ...]:
    """What identifies a message a client sends back: role, content, tool calls (name and
    arguments as parsed JSON). Ids and reasoning a client may drop are not part of it."""
    calls = tuple(
        (c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
        for c in msg.get("tool_calls") or ()
    )
    return (msg["role"], msg.get("content") or "", calls)


@dataclass
class GateTurn:
    """One stored turn: appended messages and their tokens, then the generated reply.

    Attributes:
        messages: the whole conversation at the end of this turn (stored versions).
        env_ids: tokens the request appended (the previous reply's closing, the new messages
            and the generation prompt).
        gen_ids: tokens the engine generated.
        logprobs: the engine's log-prob of each generated token.
        reply: the parsed assistant message.
        finish_reason: ``stop`` or ``length``.
        closing: what the template writes after the generated tokens (appended, untrained,
            with the next request).
        parent: the turn before (``None`` for the first).
    """

    messages: list[Message]
    env_ids: list[int]
    gen_ids: list[int]
    logprobs: list[float]
    reply: Message
    finish_reason: str
    closing: str
    parent: GateTurn | None = None

    def path(self) -> list[GateTurn]:
        """Turns from the first to this one."""
        out: list[GateTurn] = []
        node: GateTurn | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def token_ids(self) -> list[int]:
        """Every stored token from the start to the end of this turn."""
        ids: list[int] = []
        for t in self.path():
            ids += t.env_ids + t.gen_ids
        return ids


@dataclass
class GateSession:
    """A linear session of ``family`` whose turns ``generate`` (``input_ids, sampling_params
    -> GenerateAnswer``) produces.

    Attributes:
        tip: the last stored turn (``None`` before the first).
        tools: the tools of the first request (fixed for the session).
        rollbacks: turns replaced by a retry.
        requests: one line per request, for the report.
    """

    family: Any
    generate: Generate
    sampling: dict[str, Any]
    tip: GateTurn | None = None
    tools: list[dict[str, Any]] | None = None
    rollbacks: int = 0
    requests: list[str] = field(default_factory=list)
    _turns: int = 0

    def _base(self, messages: Sequence[Message]) -> tuple[GateTurn | None, bool]:
        """The stored turn ``messages`` extend, and whether the request retries the tip."""
        keys = [message_key(m) for m in messages]

        def extends(turn: GateTurn | None) -> bool:
            stored = turn.messages if turn is not None else []
            return len(keys) > len(stored) and keys[: len(stored)] == [
                message_key(m) for m in stored
            ]

        if extends(self.tip):
            return self.tip, False
        if self.tip is not None and extends(self.tip.parent):
            return self.tip.parent, True
        raise EngineGateError(
            f"request {len(self.requests) + 1} neither extends the stored conversation nor "
            "retries its last turn (the gate's session is linear)"
        )

    def window(self, history: list[Message]) -> list[Message]:
        """The part of ``history`` rendered to compute an append (see the module docstring)."""
        last = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=0)
        return history if last <= 1 else history[:1] + history[last:]

    def turn(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> Message:
        """Store one turn for the request ``messages`` and return the parsed reply."""
        fam = self.family
        if self.tip is not None and tools != self.tools:
            raise EngineGateError("the tools differ from those of the session's first request")
        base, retry = self._base(messages)
        history = base.messages if base is not None else []
        new = [dict(m) for m in messages[len(history) :]]
        ctx = self.window(history)
        prefix = fam.render(ctx, tools=tools) if ctx else ""
        prompt = fam.render(ctx + new, tools=tools, add_generation_prompt=True)
        if not prompt.startswith(prefix):
            raise EngineGateError(
                f"request {len(self.requests) + 1}: rendering the {len(new)} new message(s) "
                "changes text already rendered (the template is not append-only here)"
            )
        env_ids = fam.tokenize((base.closing if base is not None else "") + prompt[len(prefix) :])
        input_ids = (base.token_ids() if base is not None else []) + env_ids
        answer = self.generate(input_ids, dict(self.sampling))
        if answer.finish_reason == "abort":
            raise EngineGateError(f"request {len(self.requests) + 1}: the engine aborted it")
        if len(answer.logprobs) != len(answer.output_ids):
            raise EngineGateError(
                f"request {len(self.requests) + 1}: the engine returned "
                f"{len(answer.output_ids)} tokens but {len(answer.logprobs)} log-probs"
            )
        self._turns += 1
        text = fam.decode(answer.output_ids)
        parsed = fam.parse_assistant(text)
        reply: Message = {"role": "assistant", "content": parsed.get("content") or ""}
        if parsed.get("reasoning_content") is not None:
            reply["reasoning_content"] = parsed["reasoning_content"]
        if parsed.get("tool_calls"):
            reply["tool_calls"] = [
                {"id": f"call_{self._turns}_{i}", "type": "function", "function": c["function"]}
                for i, c in enumerate(parsed["tool_calls"])
            ]
        stopped = (
            answer.finish_reason == "stop"
            and bool(answer.output_ids)
            and answer.output_ids[-1] in fam.stop_token_ids
        )
        turn = GateTurn(
            messages=[*history, *new, reply],
            env_ids=env_ids,
            gen_ids=list(answer.output_ids),
            logprobs=list(answer.logprobs),
            reply=reply,
            finish_reason="stop" if answer.finish_reason == "stop" else "length",
            closing=self._closing(fam.render([*ctx, *new, reply], tools=tools), prompt, stopped),
            parent=base,
        )
        if retry:
            self.rollbacks += 1
        if self.tip is None:
            self.tools = tools
        self.tip = turn
        self.requests.append(f"{len(messages)} messages -> {json.dumps(reply)[:160]}")
        return reply

    def _closing(self, rendered: str, prompt: str, stopped: bool) -> str:
        """What the template writes after the reply: the text after its last stop token (and
        the stop token too when the generation did not end with one)."""
        if not rendered.startswith(prompt):
            return ""  # the check of the turn reports it
        canonical = rendered[len(prompt) :]
        cut, stop = -1, ""
        for s in self.family.stop_tokens:
            i = canonical.rfind(s)
            if i > cut:
                cut, stop = i, s
        tail = canonical[cut + len(stop) :] if cut >= 0 else ""
        return tail if stopped else stop + tail
