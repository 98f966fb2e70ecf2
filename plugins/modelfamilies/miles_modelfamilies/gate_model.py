"""The scripted tiny model of the engine gate, and the conversation pieces it is scripted on.

A *scripted* tiny random model is built from a config with the family's real vocabulary size
(:attr:`~miles_modelfamilies.family.TemplateFamily.vocab_size`): attention and MLP outputs are
zeroed, so the next token depends only on the current one, and the tokens of a scripted reply
get one-hot embeddings that the LM head maps to their successors. The reply is the family's own
render of an assistant turn with reasoning (when the family thinks) and the call
``lookup(city=1)``, with whitespace removed until no token repeats (a bigram model cannot say
the same token twice with different successors), so the real tool parser and the real stop
token run on engine output.

Imports torch and transformers only when a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_modelfamilies.family import TemplateFamily

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather of a city by number.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
SCRIPTED_CALL = {"name": "lookup", "arguments": {"city": 1}}


def vocab_size(family: TemplateFamily) -> int:
    """Embedding rows of the scripted model: the family's checkpoints' vocabulary (when the
    family declares none, ``vocab_size = 0``, every id of its tokenizer), and at least every
    special id of its tokenizer."""
    rows = family.vocab_size or family.tokenizer.size()
    return max(rows, max(family.tokenizer.special_ids(), default=-1) + 1)


def assistant_turn(
    family: TemplateFamily,
    content: str,
    call: dict[str, Any] | None,
    cid: str,
    *,
    reasoning: bool = True,
) -> dict[str, Any]:
    """An assistant turn with ``content``, reasoning when the family thinks (unless
    ``reasoning`` is False), and ``call``."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if family.thinking and reasoning:
        m["reasoning_content"] = "Checking."
    if call is not None:
        m["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
        ]
    return m


def _vocabulary(family: TemplateFamily) -> dict[str, int]:
    """Text of every ordinary token -> its id (tokens that decode to partial characters and
    special tokens left out)."""
    special = family.tokenizer.special_ids()
    size = vocab_size(family)
    out: dict[str, int] = {}
    for i in range(size):
        if i in special:
            continue
        try:
            text = family.decode([i])
        except Exception:  # ids past the tokenizer's vocabulary
            continue
        if text and "\ufffd" not in text and text not in out:
            out[text] = i
    return out


def _distinct_split(
    text: str, vocab: dict[str, int], specials: dict[str, int], used: set[int]
) -> list[int] | None:
    """Token ids spelling ``text`` with no id used twice (special tokens as their ids), found
    by depth-first search, longest pieces first; ``None`` when there is none (or the search
    gives up after 20,000 steps)."""
    longest = max(len(t) for t in vocab)
    text_of = {i: t for t, i in vocab.items()} | {i: t for t, i in specials.items()}
    budget = [20_000]

    def search(at: int) -> list[int] | None:
        if at == len(text):
            return []
        budget[0] -= 1
        if budget[0] < 0:
            return None
        special = [i for t, i in specials.items() if text.startswith(t, at)]
        if special:
            options = [i for i in special if i not in used]
        else:
            # An ordinary piece must not run into a special token's text.
            stop = min([p for t in specials if (p := text.find(t, at)) >= 0] + [len(text)])
            options = [
                tid
                for n in range(min(longest, stop - at), 0, -1)
                if (tid := vocab.get(text[at : at + n])) is not None and tid not in used
            ]
        for tid in options:
            used.add(tid)
            rest = search(at + len(text_of[tid]))
            if rest is not None:
                return [tid, *rest]
            used.discard(tid)
        return None

    return search(0)


def scripted_reply(family: TemplateFamily) -> tuple[int, list[int], str, bool]:
    """``(last prompt token, reply token ids, reply text, calls a tool)`` for the scripted model.

    The reply is the family's canonical render of an assistant turn calling ``lookup(city=1)``
    (reasoning ``ok`` when the family thinks), spelled with token ids that are all distinct: a
    bigram model cannot repeat a token with another successor, so the token split may differ
    from the canonical one (token drift, reported). When no such spelling exists, the same
    with newlines and then spaces removed that the parser still reads as the call (text drift,
    reported). When the format repeats a special token (DeepSeek V4's ``｜DSML｜``), the reply is
    the turn without the call, and the session's tool call is the client's. When the reasoning
    markup repeats ordinary tokens (``<think>`` and ``</think>`` written as text, both ending in
    ``>``), the reply is a turn without reasoning (a family that always reasons has none such).
    """
    ctx = [{"role": "user", "content": "Weather in city 1?"}]
    prompt = family.render(ctx, tools=TOOLS, add_generation_prompt=True)
    last = family.tokenize(prompt)[-1]
    special_ids = family.tokenizer.special_ids()
    specials = {family.decode([i]): i for i in special_ids}
    vocab = _vocabulary(family)
    tries = [(SCRIPTED_CALL, True), (None, True)]
    if family.thinking and not family.always_reasons:
        tries += [(SCRIPTED_CALL, False), (None, False)]
    for call, reasons in tries:
        turn = assistant_turn(family, "" if call else "Done", call, "call_0", reasoning=reasons)
        whole = family.render([*ctx, turn], tools=TOOLS)
        canonical = whole[len(prompt) :]
        stop = next(s for s in family.stop_tokens if s in canonical)
        body = canonical[: canonical.index(stop)]
        for text in dict.fromkeys(
            [
                body,
                body.replace("\n", ""),
                body.replace(" ", ""),
                body.replace("\n", "").replace(" ", ""),
            ]
        ):
            calls = family.parse_assistant(text + stop).get("tool_calls") or []
            if call is not None and [c["function"]["name"] for c in calls] != ["lookup"]:
                continue
            ids = _distinct_split(text, vocab, specials, {last})
            if ids is not None:
                return last, [*ids, family.tokenizer.token_id(stop)], text + stop, bool(call)
    raise RuntimeError(f"family {family.name!r}: no reply can be spelled with distinct tokens")


def make_scripted_model(
    family: TemplateFamily, path: Path, *, seed: int = 0
) -> tuple[Path, str, bool]:
    """Save the scripted tiny model for ``family`` under ``path``; returns it, the reply it
    writes and whether that reply calls a tool."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    last, ids, text, calls = scripted_reply(family)
    sources = [last, *ids[:-1]]
    hidden = 32 if len(sources) <= 32 else 64 if len(sources) <= 64 else 128
    vocab = vocab_size(family)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=16384,
        eos_token_id=family.stop_token_ids[0],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.normal_(0.0, 0.01)
        for i, (token, nxt) in enumerate(zip(sources, ids, strict=True)):
            emb[token].zero_()
            emb[token, i] = 1.0
            head[nxt, i] = 40.0 / hidden**0.5
    model.save_pretrained(path)
    return path, text, calls
