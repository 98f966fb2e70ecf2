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

The model. A real checkpoint (``model=PATH``, or the family's own
:attr:`~miles_modelfamilies.family.TemplateFamily.gate_model`: SmolLM2-135M-Instruct for
``smollm2``) generates freely (greedy). Otherwise a *scripted* tiny random model
(:mod:`miles_modelfamilies.gate_model`) replies with the family's own render of a tool call,
so the real tool parser and the real stop token run on engine output. The checks live in
:mod:`miles_modelfamilies.gate_checks`.

Imports torch and transformers (to build the scripted model) only when run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from miles_core.families.report import GateFailure, GateReport
from miles_modelfamilies.family import TemplateFamily
from miles_modelfamilies.gate_checks import GATE, check_session
from miles_modelfamilies.gate_engine import StartedEngine, choose_engine, generate, start_engine
from miles_modelfamilies.gate_model import (
    SCRIPTED_CALL,
    TOOLS,
    assistant_turn,
    make_scripted_model,
    scripted_reply,
)
from miles_modelfamilies.gate_session import GateSession
from miles_modelfamilies.options import EngineGateOptions

__all__ = [
    "GATE",
    "SCRIPTED_CALL",
    "TOOLS",
    "check_session",
    "drive_session",
    "gate_options",
    "make_scripted_model",
    "run_engine_gate",
    "scripted_reply",
]


def drive_session(
    family: TemplateFamily, engine_url: str, max_tokens: int = 64, *, timeout_s: float = 600.0
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
        assistant_turn(
            family, "Checking city 2.", {"name": "lookup", "arguments": {"city": 2}}, "call_c"
        ),
        {"role": "tool", "tool_call_id": "call_c", "content": '{"sky": "rain"}'},
        {"role": "user", "content": "Summarize both in one line."},
    ]
    messages.append(turn(messages))
    if family.system_anywhere:
        messages.append({"role": "system", "content": "Answer in one word."})
    messages.append({"role": "user", "content": "Umbrella: yes or no?"})
    turn(messages)
    return session


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


def run_engine_gate(family: TemplateFamily, report: GateReport, **options: Any) -> GateReport:
    """Run the engine gate on ``family`` and add its failures and details to ``report``.

    ``options`` are :class:`~miles_modelfamilies.options.EngineGateOptions`: ``url`` (alias
    ``engine_url``) drives a running engine whose model must be the family's; otherwise rollout
    engine ``engine`` (default: the installed one that runs on CPU) is started through the
    plugin registry with ``engine_options``, on ``model`` (a Hugging Face folder; by default
    the family's :attr:`~miles_modelfamilies.family.TemplateFamily.gate_model`, else a scripted
    tiny model).
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
            if model is None and family.gate_model is not None:
                model = family.gate_model()
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
