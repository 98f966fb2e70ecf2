"""One engine restart for both schedules: one of two engine servers is SIGKILLed in the middle
of a run, synchronous and fully asynchronous, and the same fleet code finds it dead, takes it
out of the router (``sglang-router``: generation goes through it, control calls to each engine),
restarts it, gives it the current weights before it serves again, and the run completes with a
balanced ledger.

The asynchronous schedule needs disaggregated placement; a small placement plugin puts the
trainer and its sender in this process (the ``miles_place`` hook), so the test needs no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import ENGINES_UNDER_ME, metric_rows, train, write_dist

KILLER = (
    """
import os, signal
from miles_core import Kind, hookimpl

"""
    + ENGINES_UNDER_ME
    + """

def _kill():
    os.kill(_engines()[0], signal.SIGKILL)  # engine 0: started first

@hookimpl
def miles_before_train_step(step, groups):
    if step == 2:
        _kill()

@hookimpl(tryfirst=True)  # before the Ray placement, which would take the run otherwise
def miles_place(config, launcher):
    # trainer and sender in this process, as a colocated run has them: enough for a test
    from miles_core.plugins import load_plugins
    registry = load_plugins().registry
    trainer = registry.get(Kind.TRAINER_BACKEND, config.backend.name).build(config.backend.options)
    sender = registry.get(Kind.TRANSPORT, config.transport.name).build(config.transport.options)
    return trainer, sender, launcher
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_killed_mid_run_is_restarted_by_the_fleet(
    mode: str,
    tiny_qwen3_full_vocab: Path,
    reward_site: Path,
    tmp_path: Path,
) -> None:
    write_dist(reward_site, "miles-inproc-killer", "miles_inproc_killer", KILLER, "killer")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(200)
        )
    )
    cfg = {
        "run": {
            "name": mode,
            "output_dir": str(tmp_path / "runs"),
            "steps": 4,
            "mode": mode,
            "placement": "disaggregated",
        },
        "model": {
            "path": str(tiny_qwen3_full_vocab),
            "family": "qwen3",
            "accept_unverified_family": True,
        },
        "backend": {"name": "fsdp2", "lr": 1e-2},
        # an engine left waiting in the update group of a dead peer gives up after 20 s (not
        # the default 120 s; short enough to keep the test quick, long enough for a busy CPU)
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
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = train(config, site=reward_site)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert out.stderr.count("engine 0 stopped answering: restarting it") == 1, out.stderr[-4000:]
    steps = metric_rows(tmp_path / "runs" / mode)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0, 3.0, 4.0]
    assert steps[-1]["engine/restarts"] == 1
    assert steps[-1]["engine/router_restarts"] == 0
    run = json.loads((tmp_path / "runs" / mode / "run.json").read_text())
    assert run["config"]["router"]["name"] == "sglang"  # the only router installed: the default
    for s in steps:
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
    if mode == "sync":
        # the restarted engine served the trainer's weights: the next rollouts match them
        assert steps[-1]["train/mismatch/abs_max"] < 1e-4, steps[-1]
    else:
        assert max(s["staleness/consumed_max"] for s in steps) <= 2
    ledger = json.loads((tmp_path / "runs" / mode / "ledger.json").read_text())
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
