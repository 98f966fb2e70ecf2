"""Engine faults in a real run: the engine server is killed (SIGKILL) three times — before a
weight sync, between steps, and in the middle of a rollout — and the run completes: each time
the loop restarts it, sends it the current weights through a new sender before it serves
again, counts the restart, and records the groups it lost as failed in the ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import ENGINES_UNDER_ME, metric_rows, train, write_dist

KILLER = (
    """
import os, signal
from miles_core import RewardFunction, hookimpl

"""
    + ENGINES_UNDER_ME
    + """

def _kill(where):
    pids = _engines()
    assert pids, "no engine to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    with open(os.environ["ENGINE_KILL_LOG"], "a") as f:
        f.write(where + "\\n")

@hookimpl
def miles_before_train_step(step, groups):
    if step == 2:
        _kill("before the sync of step 2")

@hookimpl
def miles_after_weight_sync(step, version, metrics):
    if step == 3:
        _kill("between steps 3 and 4")

_calls = [0]

def reward(sample, prompt):
    # Steps 1-4 score 2 groups x 2 samples each; the 17th call scores the first group of step 5
    # while the second one is still in flight on the engine.
    _calls[0] += 1
    if _calls[0] == 17:
        _kill("in the rollout of step 5")
    return (sum(sample.response_ids) % 1000) / 1000

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="killing_diversity", factory=lambda options: reward))
"""
)


@pytest.mark.slow
def test_engine_killed_three_times_the_run_completes(
    tiny_qwen3_full_vocab: Path,
    reward_site: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_dist(reward_site, "miles-killer", "miles_killer", KILLER, "killer")
    kills = tmp_path / "kills.log"
    monkeypatch.setenv("ENGINE_KILL_LOG", str(kills))
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(80)
        )
    )
    cfg = {
        "run": {"name": "faults", "output_dir": str(tmp_path / "runs"), "steps": 6},
        "model": {
            "path": str(tiny_qwen3_full_vocab),
            "family": "qwen3",
            "accept_unverified_family": True,
        },
        "backend": {"name": "fsdp2", "lr": 1e-2},
        # one request at a time: when the engine dies mid-rollout, the group still in flight
        # is lost for certain
        "engine": {"name": "embedded", "max_running_requests": 1},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "killing_diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = train(config, site=reward_site)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert kills.read_text().count("\n") == 3
    steps = metric_rows(tmp_path / "runs" / "faults")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s["engine/restarts"] for s in steps] == [0, 1, 1, 2, 3, 3]
    assert steps[-1]["ledger/dropped"] >= 1  # the groups lost with the engine, recorded
    for s in steps:
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
    # after each restart the engine serves exactly the trainer's weights (re-synced before it
    # served): its log-probs match the trainer's recomputed ones
    for s in steps[1:]:
        assert s["train/mismatch/abs_max"] < 1e-4, (s["step"], s["train/mismatch/abs_max"])
    assert out.stderr.count("stopped answering: restarting it") == 3
    ledger = json.loads((tmp_path / "runs" / "faults" / "ledger.json").read_text())
    assert ledger["dropped"] >= 1
