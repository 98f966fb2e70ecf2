"""Write the SFT example's conversation sets, offline, from reasoning-gym's ``chain_sum``: each
problem becomes a user turn (the question and " Reply with only the final number.", exactly the
main job's prompt) and an assistant turn with reasoning-gym's answer.

    python examples/chain_sum_conversations.py [--out runs/data/chain-sum-sft] [--size 2000]

writes ``train.jsonl`` (generator seed 1) and ``heldout.jsonl`` (seed 777, for the held-out
loss). Problems that are also in a held-out set (those two, and the accuracy prompts of seed
12345 that ``examples/sft.yaml`` and ``examples/main.yaml`` evaluate on) are left out of the
training set, so neither held-out figure measures memorised problems.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SUFFIX = " Reply with only the final number."
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
ACCURACY_SEED, ACCURACY_SIZE = 12345, 100


def problems(seed: int, size: int) -> list[dict[str, Any]]:
    """reasoning-gym chain_sum problems of the main job's difficulty."""
    import reasoning_gym

    return list(reasoning_gym.create_dataset("chain_sum", seed=seed, size=size, **TASK))


def conversation(entry: dict[str, Any]) -> dict[str, Any]:
    """One problem as a conversation: the question, then its answer as the assistant turn."""
    return {
        "messages": [
            {"role": "user", "content": f"{entry['question']}{SUFFIX}"},
            {"role": "assistant", "content": str(entry["answer"])},
        ],
        "answer": str(entry["answer"]),
    }


def write(path: Path, entries: list[dict[str, Any]]) -> None:
    """One conversation per line."""
    path.write_text("".join(json.dumps(conversation(e)) + "\n" for e in entries))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/data/chain-sum-sft")
    parser.add_argument("--size", type=int, default=2000, help="training conversations")
    parser.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = problems(777, args.heldout)
    seen = {e["question"] for e in [*heldout, *problems(ACCURACY_SEED, ACCURACY_SIZE)]}
    train: list[dict[str, Any]] = []
    seed = 1
    while len(train) < args.size:  # top up from the next seed what the held-out sets took
        train += [e for e in problems(seed, args.size) if e["question"] not in seen]
        seed += 1_000_003
    write(out / "train.jsonl", train[: args.size])
    write(out / "heldout.jsonl", heldout)
    print(json.dumps({"train": str(out / "train.jsonl"), "heldout": str(out / "heldout.jsonl")}))


if __name__ == "__main__":
    main()
