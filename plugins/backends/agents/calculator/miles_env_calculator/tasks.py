"""Calculator task files, written offline: ``python -m miles_env_calculator.tasks --out DIR``.

* ``train.jsonl``: prompt records for RL (``prompt``, ``answer``, ``task_id``), for the
  ``jsonl`` data source and the built-in ``last_number`` reward;
* ``heldout.jsonl``: held-out records from another seed, with ``temperature: 0`` so that the
  agent decodes greedily in the held-out evaluation;
* ``sft.jsonl``: tool-use conversations for the ``conversations`` data source (user question,
  assistant ``calculate`` call, the tool's result, assistant answer), from a third seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from miles_env_calculator.calc import calculate, format_number

#: The tool offered to the model (OpenAI format).
CALCULATE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression (numbers, + - * / and parentheses) "
        "and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
            "required": ["expression"],
        },
    },
}


def make_task(rng: random.Random, task_id: str) -> dict[str, Any]:
    """One task: a product of two 2-digit numbers, or ``a + b * c``."""
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    if rng.random() < 0.5:
        expression = f"{a} * {b}"
    else:
        expression = f"{rng.randint(100, 999)} + {a} * {b}"
    answer = format_number(calculate(expression))
    return {
        "task_id": task_id,
        "prompt": f"What is {expression}? Use the calculate tool, then give the number.",
        "expression": expression,
        "answer": answer,
    }


def conversation(task: dict[str, Any]) -> dict[str, Any]:
    """The tool-use conversation that solves ``task``."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {
            "name": "calculate",
            "arguments": json.dumps({"expression": task["expression"]}),
        },
    }
    return {
        "messages": [
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]},
            {"role": "assistant", "content": f"The answer is {task['answer']}."},
        ],
        "tools": [CALCULATE_TOOL],
    }


def tasks(seed: int, n: int, prefix: str) -> list[dict[str, Any]]:
    """``n`` tasks from ``seed``, their ids ``{prefix}-{i}``."""
    rng = random.Random(seed)
    return [make_task(rng, f"{prefix}-{i}") for i in range(n)]


def write(out: Path, n_train: int, n_heldout: int, n_sft: int) -> dict[str, int]:
    """Write the three files under ``out``; the rows written per file."""
    out.mkdir(parents=True, exist_ok=True)
    heldout = [dict(t, temperature=0.0) for t in tasks(2, n_heldout, "heldout")]
    files = {
        "train.jsonl": tasks(1, n_train, "train"),
        "heldout.jsonl": heldout,
        "sft.jsonl": [conversation(t) for t in tasks(3, n_sft, "sft")],
    }
    for name, rows in files.items():
        with (out / name).open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return {name: len(rows) for name, rows in files.items()}


def main(argv: list[str] | None = None) -> None:
    """Command line: write the task files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--sft", type=int, default=2000)
    args = parser.parse_args(argv)
    print(json.dumps(write(args.out, args.train, args.heldout, args.sft)))


if __name__ == "__main__":
    main()
