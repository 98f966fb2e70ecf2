"""A conversation rendered by its model family into training tokens, the loss mask on the
assistant turns: what supervised fine-tuning trains on.

The tokens are those the session server stores for the same conversation when the engine
writes each assistant turn canonically. The render up to the first assistant turn's generation
prompt is the prompt. After it, the text of each assistant turn, from its generation prompt
through the stop token that ends it, is trained (loss mask 1): what the engine would generate.
Everything else is not: the separator the template writes after a stop token, user, system and
tool messages, and the next generation prompt. Messages after the last assistant turn train
nothing and are left out.

The render is cut at those places (the CPU gate's turn boundaries) and each piece is tokenized
on its own, as a session tokenizes what each request appends. The pieces must give the
canonical tokens of the whole render: a verified family does for every conversation shape the
gate renders (its ``tokens`` check), and it is checked again here for every conversation, so
SFT data and RL rollouts of a family tokenize the same way.

Only the :class:`~miles_core.contracts.Family` protocol is used: no torch, no tokenizer library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


class RenderError(ValueError):
    """The conversation cannot be rendered into training tokens; the message says why."""


class NoAssistantTurn(RenderError):
    """The conversation has no assistant turn: nothing in it would be trained."""


@dataclass
class RenderedConversation:
    """Training tokens of one conversation.

    Attributes:
        prompt_ids: the render up to the first assistant turn's generation prompt, included.
        response_ids: every token after it, through the last assistant turn's stop token.
        loss_mask: one per response token; 1 on the assistant turns' tokens.
        spans: per assistant turn, the ``[start, end)`` indices of its tokens in
            ``response_ids``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    spans: list[tuple[int, int]]

    @property
    def trained_tokens(self) -> int:
        """Tokens under the loss mask."""
        return sum(self.loss_mask)


def _stop_texts(family: Any) -> tuple[str, ...]:
    return tuple(str(family.decode([i])) for i in family.stop_token_ids)


def assistant_text_spans(
    family: Any, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The render of ``messages`` through the last assistant turn, and the character span
    ``[start, end)`` of each assistant turn's generated text in it: from the end of its
    generation prompt through the stop token that ends it (the whole turn when the template
    ends it with none). Raises :class:`NoAssistantTurn`, or :class:`RenderError` when the
    template is not append-only for this conversation."""
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise NoAssistantTurn("the conversation has no assistant turn")
    messages = [dict(m) for m in messages[: turns[-1] + 1]]
    whole = str(family.render(messages, tools=tools))
    stops = _stop_texts(family)
    spans: list[tuple[int, int]] = []
    for k in turns:
        prompt = str(family.render(messages[:k], tools=tools, add_generation_prompt=True))
        after = whole if k == turns[-1] else str(family.render(messages[: k + 1], tools=tools))
        for text, upto, what in ((prompt, k, " with the generation prompt"), (after, k + 1, "")):
            if not whole.startswith(text):
                raise RenderError(
                    f"messages[{k}] (assistant): rendering messages[0:{upto}]{what} is not a "
                    "prefix of rendering the whole conversation: the family's template is not "
                    "append-only here, so these tokens would differ from a session's (the "
                    "family's CPU gate checks this: miles family verify)"
                )
        start = len(prompt)
        if spans and start < spans[-1][1]:
            raise RenderError(
                f"messages[{k}] (assistant): its generation prompt ends inside the previous "
                "assistant turn's text"
            )
        if start == 0:
            raise RenderError(
                f"messages[{k}] (assistant): nothing is rendered before the first assistant "
                "turn, so its first token has no context to be predicted from"
            )
        turn = after[start:]
        cut, stop = -1, ""
        for s in stops:
            i = turn.rfind(s)
            if i > cut:
                cut, stop = i, s
        end = start + cut + len(stop) if cut >= 0 else len(after)
        if end <= start:
            raise RenderError(f"messages[{k}] (assistant): the turn renders no text")
        spans.append((start, end))
    return whole, spans


def render_conversation(
    family: Any, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None
) -> RenderedConversation:
    """Render and tokenize ``messages`` (with the tool schemas ``tools``) with ``family``; see
    the module docstring. Raises :class:`NoAssistantTurn` when there is nothing to train on and
    :class:`RenderError` when the pieces do not give the canonical tokens."""
    whole, spans = assistant_text_spans(family, messages, tools=tools)
    pieces: list[tuple[int, int, bool]] = []  # (start, end, trained) in the text
    at = 0
    for start, end in spans:
        if start > at:
            pieces.append((at, start, False))
        pieces.append((start, end, True))
        at = end
    n_kept = len(pieces)
    if at < len(whole):  # after the last stop token: tokenized to compare, then left out
        pieces.append((at, len(whole), False))
    ids: list[int] = []
    bounds: list[tuple[int, int]] = []  # per piece: its tokens' [start, end)
    for a, b, _ in pieces:
        piece = list(family.tokenize(whole[a:b]))
        bounds.append((len(ids), len(ids) + len(piece)))
        ids += piece
    canonical = list(family.tokenize(whole))
    if ids != canonical:
        i = next((j for j, (x, y) in enumerate(zip(ids, canonical, strict=False)) if x != y), None)
        i = min(len(ids), len(canonical)) if i is None else i
        p = next((q for q, (_, e) in enumerate(bounds) if i < e), len(pieces) - 1)
        a, b, _ = pieces[p]
        raise RenderError(
            f"the text at characters {a}-{b} of the render ({whole[a:b][:60]!r}), tokenized on "
            "its own, does not give the canonical tokens of the whole render (first difference "
            f"at token {i}); a session would store other tokens than this render"
        )
    first = bounds[0][1]  # the first piece is the prompt: an assistant turn never starts at 0
    end = bounds[n_kept - 1][1]
    mask = [0] * (end - first)
    token_spans: list[tuple[int, int]] = []
    for (_, _, trained), (s, e) in zip(pieces[:n_kept], bounds[:n_kept], strict=True):
        if trained:
            mask[s - first : e - first] = [1] * (e - s)
            token_spans.append((s - first, e - first))
    return RenderedConversation(
        prompt_ids=ids[:first],
        response_ids=ids[first:end],
        loss_mask=mask,
        spans=token_spans,
    )
