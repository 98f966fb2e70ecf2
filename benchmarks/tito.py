"""Per-turn tokenization cost of the session server against re-rendering the whole history.

A session server tokenizes only what each request appends (the new messages after the stored
conversation, rendered through a window of the header and the last turn), so its per-turn cost
should not grow with the conversation. The baseline, measured in the same run, is what a
harness without token ownership does: re-render the whole conversation with the chat template
and re-tokenize all of it every turn.

Measured: the server's whole per-turn path except the engine and HTTP — ``Session.prepare``
(match the request's messages to the stored turns, render and tokenize the appended messages,
build the engine input) and ``Session.commit`` (decode and parse the reply, compare it with
its canonical render, store it). The engine is replaced by fixed generated ids (the canonical
tokens of a tool-call turn), which is enough for a microbenchmark of tokenization; the family
is ``qwen3`` with its real tokenizer. Each turn: the assistant calls a tool, the tool answers
(every fifth turn a user message instead). Median over sessions of each turn's time.

Final line: JSON with ``turn50_over_turn1`` (server) and ``rerender_turn50_over_turn1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _machine import describe

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documentation.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def _reply(turn: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "reasoning_content": f"I should search for item {turn}.",
        "tool_calls": [
            {
                "id": f"c{turn}",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": f"item {turn}"})},
            }
        ],
    }


def _after(turn: int) -> dict[str, Any]:
    if turn % 5 == 4:
        return {"role": "user", "content": f"Thanks. Now look at part {turn} of the manual."}
    return {"role": "tool", "content": f"Result {turn}: the answer is in section {turn * 7}."}


def run(turns: int, sessions: int) -> dict[str, Any]:
    from miles_modelfamilies.qwen3 import build
    from miles_sessions.appender import Appender
    from miles_sessions.store import Session

    family = build()
    appender = Appender(family)
    first = [
        {"role": "system", "content": "You answer questions using the documentation."},
        {"role": "user", "content": "How do I configure the weight transport?"},
    ]
    # The engine's output for turn t: the canonical tokens of the reply (after the prompt).
    outputs = []
    for t in range(turns):
        msgs = [*first, _reply(t)]
        whole = family.render(msgs, tools=TOOLS)
        head = family.render(first, tools=TOOLS, add_generation_prompt=True)
        outputs.append(family.tokenize(whole[len(head) :].rstrip("\n")))

    # The tokenization path proper: the appender's two calls of a turn, timed in place.
    spent = [0.0]

    def timed(f: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    appender.append = timed(appender.append)  # type: ignore[method-assign]
    appender.turn_end = timed(appender.turn_end)  # type: ignore[method-assign]
    tokenization = [[0.0] * sessions for _ in range(turns)]
    server = [[0.0] * sessions for _ in range(turns)]
    rerender = [[0.0] * sessions for _ in range(turns)]
    for s in range(sessions):
        session = Session(f"bench{s}", "linear", appender)
        messages = list(first)
        for t in range(turns):
            out = outputs[t]
            spent[0] = 0.0
            t0 = time.perf_counter()
            pending = session.prepare(messages, TOOLS)
            turn = session.commit(
                pending,
                output_ids=out,
                logprobs=[0.0] * len(out),
                finish_reason="stop",
                weight_version="0",
            )
            t1 = time.perf_counter()
            # Baseline: the whole conversation re-rendered and re-tokenized.
            ids = family.tokenize(family.render(messages, tools=TOOLS, add_generation_prompt=True))
            t2 = time.perf_counter()
            assert len(ids) == len(pending.input_ids), "the server's input is the canonical one"
            server[t][s] = t1 - t0
            tokenization[t][s] = spent[0]
            rerender[t][s] = t2 - t1
            messages += [turn.reply, _after(t)]
    med_tok = [statistics.median(x) for x in tokenization]
    med_server = [statistics.median(x) for x in server]
    med_rerender = [statistics.median(x) for x in rerender]
    last = turns - 1
    return {
        "turns": turns,
        "sessions": sessions,
        "tokenization_turn1_ms": round(med_tok[0] * 1e3, 3),
        f"tokenization_turn{turns}_ms": round(med_tok[last] * 1e3, 3),
        "prepare_commit_turn1_ms": round(med_server[0] * 1e3, 3),
        f"prepare_commit_turn{turns}_ms": round(med_server[last] * 1e3, 3),
        "rerender_turn1_ms": round(med_rerender[0] * 1e3, 3),
        f"rerender_turn{turns}_ms": round(med_rerender[last] * 1e3, 3),
        "history_tokens_at_last_turn": len(pending.input_ids),
        f"turn{turns}_over_turn1": round(med_tok[last] / med_tok[0], 3),
        f"prepare_commit_turn{turns}_over_turn1": round(med_server[last] / med_server[0], 3),
        f"rerender_turn{turns}_over_turn1": round(med_rerender[last] / med_rerender[0], 3),
    }


def main() -> None:
    """Run and print the figures; the last line is JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--sessions", type=int, default=30)
    args = p.parse_args()
    describe(vars(args))
    result = run(args.turns, args.sessions)
    for k, v in result.items():
        print(f"{k:>32}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
