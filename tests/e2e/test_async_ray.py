"""The fully asynchronous loop end to end under Ray disaggregated placement: a tiny Qwen3, the
FSDP2 trainer in a Ray actor, the embedded engine started from a Ray actor, gloo broadcast
weight sync, GRPO with the rollout log-probs as behaviour policy. A hook slows the trainer's
side down (it sleeps before each train step, on the trainer's thread), so the producer outruns
it: groups go stale and, with a one-group buffer, the producer blocks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import (
    DIVERSITY,
    RAY,
    Diversity,
    assert_ran,
    async_ray_config,
    metric_rows,
    train,
    write_dist,
)

from miles_core import hookimpl
from miles_core.config import validate_config
from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
from miles_core.runtime import Run
from miles_core.runtime import train as run_training

pytestmark = pytest.mark.slow

CAPACITY = 4  # the engine's max_running_requests: trajectories in flight per engine
GROUP = 4

# A reward that differs between the samples of a group even for a random model, and a hook
# that makes the trainer's side slow.
SITE_PLUGIN = (
    "\nimport os, time"
    + DIVERSITY
    + """
@hookimpl
def miles_before_train_step(step, groups):
    time.sleep(float(os.environ.get("SLOW_TRAIN_S", "0")))
"""
)


def _raw(tmp_path: Path, model: Path, *, steps: int, **buffer: Any) -> dict[str, Any]:
    return async_ray_config(
        tmp_path, model, steps=steps, max_running_requests=CAPACITY, group_size=GROUP, **buffer
    )


def _check_ledger(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        states = sum(r[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped"))
        assert r["ledger/produced"] == states, r
        reasons = sum(v for k, v in r.items() if k.startswith("ledger/dropped."))
        assert reasons == r["ledger/dropped"], r
        assert r["ledger/trained"] == 2 * r["step"]


def test_async_run_stays_within_the_staleness_bound(tiny_qwen3: Path, tmp_path: Path) -> None:
    site = write_dist(tmp_path / "site", "miles-slow", "miles_slow", SITE_PLUGIN, "slow")
    config = tmp_path / "run.yaml"
    bound = 1
    config.write_text(
        yaml.safe_dump(_raw(tmp_path, tiny_qwen3, steps=4, capacity=8, max_staleness=bound))
    )
    t0 = time.perf_counter()
    out = train(config, site=site, env={"MILES_RAY": RAY, "SLOW_TRAIN_S": "1.0"}, timeout=300)
    print(f"async run: {time.perf_counter() - t0:.1f} s")
    assert_ran(out)
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["steps"] == 4 and "step 4/4" in out.stderr
    rows = metric_rows(tmp_path / "runs" / "async")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    _check_ledger(rows)
    for r in rows:
        # no trained group ever exceeds the bound, at any step
        assert r["staleness/consumed_max"] <= bound, r
        assert r["buffer/size"] <= 8
        assert r["train/grad_norm"] > 0 and r["sync/bytes"] > 0
        assert r["trainer/tokens_per_s"] > 0
        # a step may see no new tokens when the full buffer holds the producer back
        assert r["rollout/tokens_per_s"] >= 0
        assert 0.0 <= r["rollout/idle_fraction"] <= 1.0
        assert 0.0 <= r["trainer/idle_fraction"] <= 1.0
    assert sum(r["rollout/tokens_per_s"] for r in rows) > 0
    # the producer outran the slow trainer: groups went stale and were dropped, by reason
    last = rows[-1]
    assert last["ledger/dropped.stale"] > 0 and last["drops/stale"] > 0
    assert last["ledger/dropped.stale"] == last["drops/stale"]
    assert {k for k in last if k.startswith("ledger/dropped.")} == {"ledger/dropped.stale"}
    # the trainer in its Ray actor sends its log-probs back: every trace line has them
    traced = (tmp_path / "runs" / "async" / "traces.jsonl").read_text().splitlines()
    lines = [json.loads(x) for x in traced]
    assert {t["step"] for t in lines} == {1, 2, 3, 4}
    for t in lines:
        assert len(t["lp_t"]) == len(t["lp_e"]) > 0 and None not in t["lp_t"], t
        assert all(d is not None for d, m in zip(t["lp_d"], t["mask"], strict=True) if m), t
    # the run's end dropped what was still in flight or queued, and said so
    ledger = json.loads((tmp_path / "runs" / "async" / "ledger.json").read_text())
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
    assert ledger["trained"] == 8
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"]
    assert set(k for k in ledger if k.startswith("dropped.")) <= {
        "dropped.stale",
        "dropped.run_ended",
    }


class SlowTrainer(Diversity):
    """A diversity reward and a trainer side that sleeps before each step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @hookimpl
    def miles_before_train_step(self, step, groups):
        time.sleep(self.seconds)


def test_a_full_buffer_blocks_the_producer_and_drops_nothing(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_RAY", RAY)
    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(SlowTrainer(1.5), name="slow", distribution="test", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    raw = _raw(tmp_path, tiny_qwen3, steps=3, capacity=1, max_staleness=100, pause_mode="freeze")
    t0 = time.perf_counter()
    run_training(Run(validate_config(raw, plugins.registry), plugins))
    print(f"back-pressure run: {time.perf_counter() - t0:.1f} s")
    rows = metric_rows(tmp_path / "runs" / "async")
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_ledger(rows)
    for r in rows:
        assert r["buffer/size"] <= 1 and r["buffer/capacity"] == 1
        # nothing is dropped while the run goes on: a full buffer never drops, it blocks
        assert r["ledger/dropped"] == 0, r
        # the producer never runs ahead of what the engine can hold
        assert r["rollout/trajectories_in_flight"] <= CAPACITY + GROUP - 1
    # while the trainer slept the buffer was full and the producer waited with free slots
    blocked = [r["rollout/blocked_fraction"] for r in rows[1:]]
    assert min(blocked) > 0.2, blocked
    assert all(r["rollout/idle_fraction"] > 0.2 for r in rows[1:]), rows
    # groups at most a few versions old: the producer stopped instead of running ahead
    assert max(r["staleness/consumed_max"] for r in rows) <= 2
