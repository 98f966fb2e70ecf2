"""The tokenization path: what a request appends to a stored conversation, in tokens.

A session stores the exact tokens of every turn. A new request brings new messages after the
stored ones; only those are rendered and tokenized, as the difference between the family's
render of the stored conversation and its render with the new messages and the generation
prompt. That difference is the canonical text of the appended messages only if the template is
append-only, which the family's CPU gate verifies over many shapes; here it is checked again on
every request, and a template that rewrites what was already rendered is refused loudly.

**Render window.** Rendering the whole history costs time proportional to its length. The
appended text of a template that is append-only and *local* (a message renders from itself,
the message before it, the header — the first message — and the tools) is the same when the
history is cut to ``messages[:1] + messages[last_assistant:]``. That is the default
(``window="turn"``): per-turn cost independent of the history. ``window="full"`` renders
everything; ``verify_window=True`` computes both and refuses a difference (tests run every
shipped family through it).

**Boundaries.** A turn's stored tokens are the appended text's tokens followed by the generated
ones; the trainer's canonical tokens are those of the whole text. Where a special token sits
between the two (``<|im_start|>assistant\n``) nothing can merge; where a template lets the
reply continue plain text (a system message with no assistant marker after it), the reply's
first token may merge with the text before it (stored ``'.', 'Got'``, canonical ``'.G', 'ot'``).
:meth:`Appender.boundary` tokenizes the characters around such a join and says where the
stored split is not the canonical one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from miles_core.contracts import Family

log = logging.getLogger("miles_sessions")

Message = dict[str, Any]


class NotAppendOnly(RuntimeError):
    """The family's template changed text it had already rendered (what the gate guards)."""


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (or the shorter length)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


#: Characters on each side of a join that :meth:`Appender.boundary` tokenizes: more than any
#: token or pre-tokenizer piece spans, so a merge across the join shows within them.
BOUNDARY_CHARS = 256


def show_difference(a: str, b: str, at: int, context: int = 40) -> str:
    """Both strings around ``at``, for an error message."""
    lo = max(0, at - context)
    return f"stored: …{a[lo : at + context]!r}…\n    render: …{b[lo : at + context]!r}…"


@dataclass
class TurnText:
    """What one request appends: the text, its token ids and the render the generation
    prompt ended (kept to split the assistant turn that follows)."""

    text: str
    ids: list[int]
    context: list[Message]
    prompt_render: str
    tools: list[dict[str, Any]] | None = None


@dataclass
class TurnEnd:
    """How a generated assistant turn relates to its canonical render.

    Attributes:
        closing: text the template writes after the generated tokens and before the next
            message (``"\\n"`` after a stop token; the stop token itself too when the
            generation was cut short); appended, untrained, with the next request.
        canonical: whether the generated text (plus ``closing``) is exactly the canonical
            render of the parsed turn.
        difference: where they first differ, when not canonical.
    """

    closing: str
    canonical: bool
    difference: str = ""
    #: The next request's render window (header and this reply) and its render, cached.
    window: list[Message] | None = None
    window_render: str = ""


class Appender:
    """Renders and tokenizes what a request appends, for one model family.

    Args:
        family: a :class:`miles_core.contracts.Family`.
        window: ``"turn"`` (render the header and the last assistant turn on) or ``"full"``.
        verify_window: also render the full history and refuse any difference.
    """

    def __init__(
        self,
        family: Family,
        *,
        window: Literal["turn", "full"] = "turn",
        verify_window: bool = False,
    ) -> None:
        self.family = family
        self.window = window
        self.verify_window = verify_window
        self.stop_texts = tuple(family.decode([i]) for i in family.stop_token_ids)
        # Agent text is rendered with control-token strings escaped, so the tokenizer encodes
        # it as text: a message cannot forge a turn with `<|im_end|>` (a family without an
        # escape renders it plainly). Every render here is of that kind; ``_unescape`` gives
        # the text as the client wrote it.
        self._render = family.render_escaped
        self._unescape = family.unescape
        # render([header], generation prompt) per header message, reused by every turn.
        self._head_prompts: dict[int, tuple[Message, Any, str]] = {}

    def context(self, history: list[Message]) -> list[Message]:
        """The part of ``history`` rendered to compute an append."""
        if self.window == "full" or len(history) <= 2:
            return history
        last = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=0)
        if last <= 1:
            return history
        return history[:1] + history[last:]

    def _append_text(
        self,
        ctx: list[Message],
        new: list[Message],
        tools: list[dict[str, Any]] | None,
        prefix: str | None = None,
    ) -> tuple[str, str]:
        if prefix is None:
            prefix = self._render(ctx, tools=tools) if ctx else ""
        whole = self._render(ctx + new, tools=tools, add_generation_prompt=True)
        if not whole.startswith(prefix):
            at = first_difference(prefix, whole)
            msg = (
                f"family {self.family.name!r} is not append-only for this conversation: "
                f"rendering it with the {len(new)} new message(s) changes text already "
                f"rendered at character {at}:\n    " + show_difference(prefix, whole, at) + "\n"
                "Stored tokens would no longer match the template; the family's CPU gate "
                "guards against this (run `miles family verify`)."
            )
            log.error(msg)
            raise NotAppendOnly(msg)
        return whole[len(prefix) :], whole

    def append(
        self,
        history: list[Message],
        new: list[Message],
        tools: list[dict[str, Any]] | None,
        *,
        closing: str = "",
        cached: tuple[list[Message], str] | None = None,
    ) -> TurnText:
        """Text and ids appended by ``new`` after ``history`` (whose last assistant turn needs
        ``closing``), ending with the generation prompt. ``cached`` is a window and its render
        from :meth:`turn_end`, used when it is this request's window."""
        ctx = self.context(history)
        prefix = None
        if cached is not None and _same(cached[0], ctx):
            prefix = cached[1]
        text, whole = self._append_text(ctx, new, tools, prefix)
        if self.verify_window and ctx is not history:
            full_text, _ = self._append_text(history, new, tools)
            if full_text != text:
                at = first_difference(full_text, text)
                raise NotAppendOnly(
                    f"family {self.family.name!r}: the windowed render differs from the full "
                    f"render at character {at} of the appended text:\n    "
                    + show_difference(full_text, text, at)
                    + "\nuse window='full' for this family"
                )
        text = closing + text
        return TurnText(text, self.family.tokenize(text), ctx + new, whole, tools)

    def turn_end(
        self, turn: TurnText, reply: Message, generated_text: str, stopped: bool
    ) -> TurnEnd:
        """Compare a generated turn with the canonical render of its parsed ``reply`` and
        say what the template writes after it.

        With the turn window, the reply is rendered after the header message alone: that
        render is also the next request's window, so it is cached for it and a turn costs two
        renders in all."""
        if self.window == "turn":
            head = turn.context[0]
            window = [head, reply] if head is not reply else [reply]
            rendered = self._render(window, tools=turn.tools)
            prompt = self._head_prompt(head, turn.tools)
        else:
            window = [*turn.context, reply]
            rendered = self._render(window, tools=turn.tools)
            prompt = turn.prompt_render
        if not rendered.startswith(prompt):
            at = first_difference(prompt, rendered)
            return TurnEnd(
                "",
                False,
                "the generation prompt is not a prefix of the rendered turn:\n    "
                + show_difference(prompt, rendered, at),
            )
        canonical = rendered[len(prompt) :]
        if self.verify_window and self.window == "turn":
            full = self._render([*turn.context, reply], tools=turn.tools)
            if full[len(turn.prompt_render) :] != canonical:
                at = first_difference(full[len(turn.prompt_render) :], canonical)
                msg = (
                    f"family {self.family.name!r}: the reply renders differently after the "
                    "header alone than in its context:\n    "
                    + show_difference(full[len(turn.prompt_render) :], canonical, at)
                )
                log.error(msg)
                return TurnEnd("", False, msg)
        # The template ends the turn with a stop token and maybe a separator after it.
        cut, stop = -1, ""
        for s in self.stop_texts:
            i = canonical.rfind(s)
            if i > cut:
                cut, stop = i, s
        tail = canonical[cut + len(stop) :] if cut >= 0 else ""
        closing = tail if stopped else stop + tail
        produced = generated_text + closing
        canonical = self._unescape(canonical)
        if produced == canonical:
            return TurnEnd(closing, True, "", window, rendered)
        at = first_difference(produced, canonical)
        return TurnEnd(closing, False, show_difference(produced, canonical, at), window, rendered)

    def boundary(self, before: str, after: str) -> str:
        """Whether ``after`` tokenized on its own, following ``before`` tokenized on its own,
        gives the canonical tokens of ``before + after`` at the join: ``""`` when it does, else
        the tokens around the join both ways (the stored split and the canonical one).

        Only the :data:`BOUNDARY_CHARS` characters on each side are tokenized: cutting both
        tokenizations at the same outer points leaves the join as their only difference."""
        if not before or not after:
            return ""
        tail, head = before[-BOUNDARY_CHARS:], after[:BOUNDARY_CHARS]
        tokenize = self.family.tokenize
        left = list(tokenize(tail))
        split = left + list(tokenize(head))
        whole = list(tokenize(tail + head))
        if split == whole:
            return ""
        n = len(left)

        def around(ids: list[int], at: int) -> list[str]:
            return [self.family.decode([t]) for t in ids[max(0, at - 2) : at + 2]]

        return (
            f"the text before the join ends {tail[-20:]!r} and the text after it starts "
            f"{head[:20]!r}: stored {around(split, n)!r}, canonical {around(whole, n)!r} "
            "(the two turns' tokens merge; the template writes no special token between them)"
        )

    def joins(self, previous: str, appended: str, generated: str) -> str:
        """Where a turn's tokens merge across its joins: the previous reply's text and the
        appended text (which starts with its closing), and the appended text (ending with the
        generation prompt) and the generated reply (see :meth:`boundary`). ``""`` when both
        joins are canonical. The turn is stored as generated either way; the session counts
        it (``merged_boundaries``)."""
        found = []
        for where, before, after in (
            ("after the previous reply", previous, appended),
            ("before the reply", appended, generated),
        ):
            detail = self.boundary(before, after)
            if detail:
                found.append(f"{where}: {detail}")
        return "; ".join(found)

    def _head_prompt(self, head: Message, tools: Any) -> str:
        hit = self._head_prompts.get(id(head))
        if hit is not None and hit[0] is head and hit[1] == tools:
            return hit[2]
        prompt: str = self._render([head], tools=tools, add_generation_prompt=True)
        if len(self._head_prompts) > 4096:
            self._head_prompts.clear()
        self._head_prompts[id(head)] = (head, tools, prompt)
        return prompt


def _same(a: list[Message], b: list[Message]) -> bool:
    """The same messages, as objects (a cached render belongs to those exact messages)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
