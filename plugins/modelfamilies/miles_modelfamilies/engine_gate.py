"""The engine gate: a real model on a real engine drives a scripted session, and the stored
tokens are checked against the family's canonical render.

The CPU gate proves that the template *allows* a session to store tokens incrementally. This
gate runs the real path against any engine speaking SGLang's native HTTP API (the engine
contract, :class:`miles_core.contracts.EngineClient`): a running engine given by URL (e.g.
SGLang on a GPU), or one started here through the plugin registry (by default the installed
rollout engine whose record says it runs on CPU). The session's token bookkeeping is the gate's
own (:mod:`miles_modelfamilies.gate_session`: exact stored tokens, only what a request appends
is rendered and tokenized, a retry rolls the last turn back), with the family's stop tokens and
its real parsers on what the engine generated. This module imports no other plugin. The
scripted session has four turns and a retry:

1. system + user (tools offered) -> reply; the same request again: the linear session **rolls
   the turn back** and generates it anew;
2. the tool results of the reply's calls (a user message when it called none) -> reply;
3. user, an **assistant turn written by the client** (with reasoning when the family thinks, and a
   tool call), its **tool** result, user -> reply;
4. a **system** message (when the template renders one after the first message), user -> reply.

Checks, for every turn on the stored path (``P`` = full render up to the turn with the
generation prompt, ``A`` = full render including the reply; renders are of the whole history,
not the session's render window):

* ``engine_text``: the text the session appended before the reply is exactly the canonical
  text between the previous reply and the generation prompt (``P[len(A_prev):]``), after the
  previous reply's closing; the quoted first difference names the turn;
* ``engine_tokens``: those appended tokens are the tokenization of that text, and the special
  tokens (the tokenizer's added tokens: role markers, ``<think>``, tool-call tags, stop tokens)
  of every segment, generated ones included, are those of the canonical render, in order (the
  report names the first special token that differs);
* ``engine_stop``: a scripted model ends every reply with one of the family's stop tokens;
* ``engine_tool_call``: at least one tool call was parsed from engine output (scripted model), or
  the session holds one written by the client (a real model that calls none is reported);
* ``engine_rollback``: the retry replaced the turn (``rollbacks == 1``);
* ``engine_whole``: when no reply drifted, the stored tokens plus the last closing are exactly
  ``tokenize(render(whole conversation))``.

Assistant-text drift (a reply whose generated text plus closing is not the canonical render of
its parsed message: different whitespace, JSON spacing, a token split the tokenizer would not
make) is not a failure: the session keeps what was generated. It is counted and reported
(``text_drift_turns``, ``token_drift_turns``, the first difference of each).

The model. A real checkpoint (``model=PATH``; SmolLM2-135M-Instruct for ``smollm2`` by default)
generates freely (greedy). Otherwise a *scripted* tiny random model is built from a config with
the family's real vocabulary size: attention and MLP outputs are zeroed, so the next token
depends only on the current one, and the tokens of a scripted reply get one-hot embeddings that
the LM head maps to their successors. The reply is the family's own render of an assistant turn
with reasoning ``ok`` (when the family thinks) and the call ``lookup(city=1)``, with whitespace
removed until no token repeats (a bigram model cannot say the same token twice with different
successors), so the real tool parser and the real stop token run on engine output.

Imports torch and transformers (to build the scripted model) only when run.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from miles_core.families.report import GateFailure, GateReport, first_difference, show_difference
from miles_modelfamilies.gate_engine import StartedEngine, choose_engine, generate, start_engine
from miles_modelfamilies.gate_session import GateSession
from miles_modelfamilies.options import EngineGateOptions

GATE = "engine"
#: Embedding rows of the real checkpoints (the model config's ``vocab_size``).
VOCAB_SIZES = {
    "smollm2": 49152,
    "qwen3": 151936,
    "qwen3_thinking_2507": 151936,
    "qwen3_5": 248320,
    "deepseek_v4": 129280,
}
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


# --- the scripted model ------------------------------------------------------------------------


def _assistant(family: Any, content: str, call: dict[str, Any] | None, cid: str) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if getattr(family, "thinking", False):
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


def _vocabulary(family: Any) -> dict[str, int]:
    """Text of every ordinary token -> its id (tokens that decode to partial characters and
    special tokens left out)."""
    special = family.tokenizer.special_ids()
    size = max(VOCAB_SIZES.get(family.name, 0), max(special) + 1)
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


def scripted_reply(family: Any) -> tuple[int, list[int], str, bool]:
    """``(last prompt token, reply token ids, reply text, calls a tool)`` for the scripted model.

    The reply is the family's canonical render of an assistant turn calling ``lookup(city=1)``
    (reasoning ``ok`` when the family thinks), spelled with token ids that are all distinct: a
    bigram model cannot repeat a token with another successor, so the token split may differ
    from the canonical one (token drift, reported). When no such spelling exists, the same
    with newlines and then spaces removed that the parser still reads as the call (text drift,
    reported). When the format repeats a special token (DeepSeek V4's ``｜DSML｜``), the reply is
    the turn without the call, and the session's tool call is the client's.
    """
    ctx = [{"role": "user", "content": "Weather in city 1?"}]
    prompt = family.render(ctx, tools=TOOLS, add_generation_prompt=True)
    last = family.tokenize(prompt)[-1]
    special_ids = family.tokenizer.special_ids()
    specials = {family.decode([i]): i for i in special_ids}
    vocab = _vocabulary(family)
    for call in (SCRIPTED_CALL, None):
        whole = family.render(
            [*ctx, _assistant(family, "" if call else "Done", call, "call_0")], tools=TOOLS
        )
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


def make_scripted_model(family: Any, path: Path, *, seed: int = 0) -> tuple[Path, str, bool]:
    """Save the scripted tiny model for ``family`` under ``path``; returns it, the reply it
    writes and whether that reply calls a tool."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    last, ids, text, calls = scripted_reply(family)
    sources = [last, *ids[:-1]]
    hidden = 32 if len(sources) <= 32 else 64 if len(sources) <= 64 else 128
    vocab = max(VOCAB_SIZES.get(family.name, 0), max(family.tokenizer.special_ids()) + 1)
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


# --- driving the session -----------------------------------------------------------------------


def drive_session(
    family: Any, engine_url: str, max_tokens: int = 64, *, timeout_s: float = 600.0
) -> GateSession:
    """Run the scripted session against the engine at ``engine_url`` (greedy, the family's stop
    tokens); returns the stored :class:`~miles_modelfamilies.gate_session.GateSession`."""
    session = GateSession(
        family,
        lambda ids, params: generate(engine_url, ids, params, timeout_s=timeout_s),
        {
            "max_new_tokens": max_tokens,
            "temperature": 0.0,
            "stop_token_ids": list(family.stop_token_ids),
        },
    )

    def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
        # The client sends back what it received, as an OpenAI client would.
        return dict(session.turn(messages, TOOLS))

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in city 1? Call lookup."},
    ]
    turn(messages)  # turn 1, then the retry rolls it back
    reply = turn(messages)
    messages.append(reply)
    calls = reply.get("tool_calls") or []
    if calls:
        messages += [
            {"role": "tool", "tool_call_id": c.get("id"), "content": '{"sky": "clear"}'}
            for c in calls
        ]
    else:
        messages.append({"role": "user", "content": "Please call the tool."})
    messages.append(turn(messages))
    messages += [
        {"role": "user", "content": "Now city 2, please."},
        _assistant(
            family, "Checking city 2.", {"name": "lookup", "arguments": {"city": 2}}, "call_c"
        ),
        {"role": "tool", "tool_call_id": "call_c", "content": '{"sky": "rain"}'},
        {"role": "user", "content": "Summarize both in one line."},
    ]
    messages.append(turn(messages))
    if getattr(family, "system_anywhere", True):
        messages.append({"role": "system", "content": "Answer in one word."})
    messages.append({"role": "user", "content": "Umbrella: yes or no?"})
    turn(messages)
    return session


def _specials(ids: list[int], special: frozenset[int]) -> list[int]:
    return [i for i in ids if i in special]


def _name(family: Any, ids: Sequence[int], at: int) -> str:
    """``'<tool_call>' (151657)`` for ``ids[at]``, or ``<end>`` past the end."""
    return f"{family.decode([ids[at]])!r} ({ids[at]})" if at < len(ids) else "<end>"


def check_session(
    family: Any,
    session: Any,
    *,
    scripted: bool,
    report: GateReport,
    expect_tool_call: bool | None = None,
) -> dict[str, Any]:
    """Run the checks on a finished session (see the module docstring); failures go into
    ``report``; returns the details (drift counts and differences)."""
    special = family.tokenizer.special_ids()
    tools = session.tools
    path = session.tip.path()
    details: dict[str, Any] = {"turns": len(path), "rollbacks": session.rollbacks}

    def fail(check: str, turn: int, role: str, detail: str) -> None:
        report.failures.append(GateFailure(GATE, "scripted_session", check, turn, role, detail))

    prev_render, prev_closing = "", ""
    text_drift: list[str] = []
    token_drift: list[int] = []
    engine_calls = 0
    unstopped = []
    for n, t in enumerate(path, start=1):
        ctx = t.messages[:-1]
        where = len(ctx)  # message index of the reply
        prompt = family.render(ctx, tools=tools, add_generation_prompt=True)
        after = family.render(t.messages, tools=tools)
        if not prompt.startswith(prev_render):
            at = first_difference(prev_render, prompt)
            fail(
                "engine_text",
                where - 1,
                ctx[-1]["role"],
                f"turn {n}: the render before this "
                f"request is not a prefix of the render with it. First difference at {at}:\n"
                + show_difference("before", prev_render, "now", prompt, at),
            )
        env_text = prev_closing + prompt[len(prev_render) :]
        stored = family.decode(t.env_ids)
        if stored != env_text:
            at = first_difference(stored, env_text)
            fail(
                "engine_text",
                where - 1,
                ctx[-1]["role"],
                f"turn {n}: the text the session "
                f"appended is not the canonical text before the reply. First difference at "
                f"character {at}:\n" + show_difference("stored", stored, "canonical", env_text, at),
            )
        expected_ids = family.tokenize(env_text)
        if list(t.env_ids) != expected_ids:
            at = first_difference(list(t.env_ids), expected_ids)  # type: ignore[arg-type]
            fail(
                "engine_tokens",
                where - 1,
                ctx[-1]["role"],
                f"turn {n}: the appended tokens "
                f"are not the tokenization of the canonical text; first difference at token "
                f"{at}: {list(t.env_ids)[at : at + 6]} vs {expected_ids[at : at + 6]}",
            )
        if not after.startswith(prompt):
            fail(
                "engine_text",
                where,
                "assistant",
                f"turn {n}: the render with the reply does "
                "not start with the render with the generation prompt",
            )
            prev_render, prev_closing = after, t.closing
            continue
        canonical_reply = after[len(prompt) :]
        generated = family.decode(t.gen_ids)
        got = _specials(list(t.gen_ids) + family.tokenize(t.closing), special)
        want = _specials(family.tokenize(canonical_reply), special)
        if got != want:
            at = first_difference(got, want)  # type: ignore[arg-type]
            fail(
                "engine_tokens",
                where,
                "assistant",
                f"turn {n}: the special tokens of the generated reply (plus closing) are not "
                f"those of its canonical render; first difference at special token {at}: "
                f"{_name(family, got, at)} vs {_name(family, want, at)} (generated "
                f"{[family.decode([i]) for i in got]}, canonical "
                f"{[family.decode([i]) for i in want]})",
            )
        if generated + t.closing != canonical_reply:
            at = first_difference(generated + t.closing, canonical_reply)
            text_drift.append(
                f"turn {n} at character {at}:\n"
                + show_difference(
                    "generated", generated + t.closing, "canonical", canonical_reply, at
                )
            )
        if list(t.gen_ids) != family.tokenize(generated):
            token_drift.append(n)
        engine_calls += len((t.reply or {}).get("tool_calls") or [])
        stopped = t.finish_reason == "stop" and t.gen_ids and t.gen_ids[-1] in family.stop_token_ids
        if not stopped:
            unstopped.append(n)
        prev_render, prev_closing = after, t.closing
    details.update(
        text_drift_turns=len(text_drift),
        token_drift_turns=len(token_drift),
        drift=text_drift,
        engine_tool_calls=engine_calls,
        replies_without_stop_token=unstopped,
    )
    if scripted and unstopped:
        fail(
            "engine_stop",
            -1,
            "",
            f"replies of turns {unstopped} did not end with a stop token "
            f"{list(family.stop_tokens)}",
        )
    client_calls = (
        sum(
            len(m.get("tool_calls") or []) for m in session.tip.messages if m["role"] == "assistant"
        )
        - engine_calls
    )
    if expect_tool_call is None:
        expect_tool_call = scripted
    if expect_tool_call and engine_calls == 0:
        fail("engine_tool_call", -1, "", "the scripted model's replies parsed to no tool call")
    elif engine_calls + client_calls == 0:
        fail("engine_tool_call", -1, "", "the session holds no tool call")
    if session.rollbacks != 1:
        fail(
            "engine_rollback",
            -1,
            "",
            f"the retried turn was not rolled back (rollbacks = {session.rollbacks})",
        )
    if not text_drift and not token_drift:
        whole = family.render(session.tip.messages, tools=tools)
        stored = session.tip.token_ids() + family.tokenize(session.tip.closing)
        canonical = family.tokenize(whole)
        if stored != canonical:
            at = first_difference(stored, canonical)  # type: ignore[arg-type]
            fail(
                "engine_whole",
                -1,
                "",
                f"the stored tokens are not tokenize(render(whole)); "
                f"first difference at token {at}: {stored[at : at + 6]} vs "
                f"{canonical[at : at + 6]}",
            )
    return details


def gate_options(options: dict[str, Any]) -> EngineGateOptions:
    """Validate the engine gate's options; a bad one is a user error naming the field."""
    from miles_core.config import format_validation_error
    from miles_core.errors import ConfigError

    try:
        return EngineGateOptions.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, "engine gate option", EngineGateOptions)
        ) from None


def run_engine_gate(family: Any, report: GateReport, **options: Any) -> GateReport:
    """Run the engine gate on ``family`` and add its failures and details to ``report``.

    ``options`` are :class:`~miles_modelfamilies.options.EngineGateOptions`: ``url`` (alias
    ``engine_url``) drives a running engine whose model must be the family's; otherwise rollout
    engine ``engine`` (default: the installed one that runs on CPU) is started through the
    plugin registry with ``engine_options``, on ``model`` (a Hugging Face folder; by default
    the converted SmolLM2 for ``smollm2`` and a scripted tiny model for other families).
    A bad option, or no engine to start, raises before anything starts; what goes wrong while
    the gate runs is a failure in the report.
    """
    opts = gate_options(options)
    choice = choose_engine(opts.engine, opts.engine_options) if opts.url is None else None
    started = time.perf_counter()
    scripted = opts.scripted and opts.url is not None
    engine: StartedEngine | None = None
    tmp = None
    details: dict[str, Any] = {}
    expect_call = False
    model = opts.model
    url = opts.url
    try:
        if scripted:
            _, _, details["scripted_reply"], expect_call = scripted_reply(family)
        if choice is not None:
            if model is None and family.name == "smollm2":
                from miles_modelfamilies.smollm2_model import smollm2_model_folder

                model = str(smollm2_model_folder())
            if model is None:
                tmp = tempfile.TemporaryDirectory(prefix=f"miles-engine-gate-{family.name}-")
                path, text, expect_call = make_scripted_model(family, Path(tmp.name))
                model, scripted = str(path), True
                details["scripted_reply"] = text
                if not expect_call:
                    details["note"] = (
                        "the family's tool-call format cannot be spelled by the scripted bigram "
                        "model (a token repeats); the session's tool call is the client's"
                    )
            engine = start_engine(choice, model)
            url = engine.url
            details["rollout_engine"] = choice.name
        details.update(
            model=model or "(engine at the given URL)", scripted=scripted, engine_url=url
        )
        limit = opts.max_tokens or (64 if scripted else 48)
        session = drive_session(family, str(url), limit, timeout_s=opts.timeout_s)
        details["requests"] = session.requests
        details.update(
            check_session(
                family, session, scripted=scripted, report=report, expect_tool_call=expect_call
            )
        )
    except Exception as exc:
        report.failures.append(
            GateFailure(GATE, "scripted_session", "engine", -1, "", f"{type(exc).__name__}: {exc}")
        )
    finally:
        if engine is not None:
            engine.shutdown()
        if tmp is not None:
            tmp.cleanup()
    report.shapes.append("scripted_session")
    report.checks += 6
    report.seconds += time.perf_counter() - started
    report.details[GATE] = details
    return report
