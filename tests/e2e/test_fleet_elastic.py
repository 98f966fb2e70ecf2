"""Engines join and leave a running job, both schedules: a run of two engine servers asks for a
third after step 2 (``miles fleet join``'s request in the run folder); once the third serves,
it drains the first two, and the rest of the run generates on the engine that joined. The run
completes on it with the trainer's weights: every step's weight version is the step's, the
ledger balances at every step and every drop has a named reason.

The placement is the test's (the ``miles_place`` hook: the trainer and its sender in this
process), so it needs no Ray; the Ray placement's joins are its plugin's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import metric_rows, train, write_dist

ELASTIC = """
import json, os, time
from pathlib import Path
from miles_core import Kind, hookimpl
from miles_core.runtime.control import request

_run = []

@hookimpl
def miles_run_start(config, run_dir):
    _run[:] = [Path(run_dir)]

def _last_row():
    try:
        lines = (_run[0] / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    rows = [json.loads(line) for line in lines]
    rows = [r for r in rows if "engine/serving" in r]
    return rows[-1] if rows else {}

@hookimpl
def miles_after_train_step(step, groups, metrics):
    marker = _run[0] / "drained_after"
    if step == 2:
        request(_run[0], {"action": "join", "engines": 1})
    elif step > 2 and not marker.exists():
        if _last_row().get("engine/serving") == 3:
            request(_run[0], {"action": "drain", "engine": 0})
            request(_run[0], {"action": "drain", "engine": 1})
            marker.write_text(str(step))
        else:  # steps are faster than an engine's start: give it time, not steps
            time.sleep(2.0)

@hookimpl(tryfirst=True)  # before the Ray placement, which would take the run otherwise
def miles_place(config, launcher):
    from miles_core.plugins import load_plugins
    registry = load_plugins().registry
    trainer = registry.get(Kind.TRAINER_BACKEND, config.backend.name).build(config.backend.options)
    sender = registry.get(Kind.TRANSPORT, config.transport.name).build(config.transport.options)
    return trainer, sender, launcher
"""

STEPS = 24


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_joins_and_the_first_two_are_drained(
    mode: str,
    tiny_qwen3_full_vocab: Path,
    reward_site: Path,
    tmp_path: Path,
) -> None:
    write_dist(reward_site, "miles-elastic", "miles_elastic", ELASTIC, "elastic")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(400)
        )
    )
    cfg = {
        "run": {
            "name": mode,
            "output_dir": str(tmp_path / "runs"),
            "steps": STEPS,
            "mode": mode,
            "placement": "disaggregated",
        },
        "model": {
            "path": str(tiny_qwen3_full_vocab),
            "family": "qwen3",
            "accept_unverified_family": True,
        },
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {
            "name": "embedded",
            "max_running_requests": 4,
            "num_engines": 2,
            "dist_timeout": 20,
        },
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
        "buffer": {"capacity": 4, "max_staleness": 2},
    }
    if mode == "sync":
        cfg["router"] = None  # each engine a route of its own; async goes through the router
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = train(config, site=reward_site)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    run = tmp_path / "runs" / mode
    assert "engine 2 joined at" in out.stderr, out.stderr[-4000:]
    assert (run / "drained_after").is_file(), out.stderr[-4000:]  # engine 2 served
    drained = int((run / "drained_after").read_text())  # requested after this step
    assert drained < STEPS - 2, "too few steps were left to run on the joined engine alone"
    outcomes = [json.loads(p.read_text()) for p in sorted((run / "control" / "done").iterdir())]
    assert outcomes == [
        {"ok": True, "joining": [2]},
        {"ok": True, "left": 0},
        {"ok": True, "left": 1},
    ]
    steps = metric_rows(run)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["weight_version"] for s in steps] == [float(s) for s in range(1, STEPS + 1)]
    for s in steps:
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
        reasons = sum(v for k, v in s.items() if k.startswith("ledger/dropped."))
        assert reasons == s["ledger/dropped"], s
        assert s["engine/restarts"] == 0
    # the requests are applied at the next step's start; from then on engine 2 serves alone
    for s in steps[drained:]:
        assert (s["engine/serving"], s["engine/joined"], s["engine/left"]) == (1, 1, 2), s
    # it copied the weights of an engine that served them (embedded: weights_from_peer)
    assert "engine 2 copied the weights of engine" in out.stderr, out.stderr[-4000:]
    assert steps[-1]["engine/copied_weights"] == 1.0
    if mode == "sync":
        # the engine that joined serves the trainer's weights: the rollouts match them
        assert steps[-1]["train/mismatch/abs_max"] < 1e-4, steps[-1]
    else:
        assert max(s["staleness/consumed_max"] for s in steps) <= 2
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
    assert ledger["trained"] == 2 * STEPS
