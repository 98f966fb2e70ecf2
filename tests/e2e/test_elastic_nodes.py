"""An elastic fleet across nodes: a three-node loopback Ray cluster (the trainer's rank on the
head, engines 0 and 1 on the other two) and a fourth node started mid-run, in a fully
asynchronous run:

- after step 2 the fourth node starts; the run watches its cluster (the Ray placement's
  ``join_new_nodes``, ``max_engines: 3``), so one engine joins at step 3's start, unasked
  (Ray places it on the new node, the only one with room), copies the weights an engine serves,
  and serves with the trainer's version from the update after step 4 at the latest;
- engine 0 is drained at step 5 (its node stays, its bundle held);
- after step 6 engine 1's node is killed (every process of it): the fleet finds the engine dead,
  its restart cannot be placed (no node has room for its bundle), so it leaves the job;
- the run finishes on the engine that joined: no group lost (the ledger balances at every
  step, every drop named), every step's weights are the step's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import Diversity, save_tiny_qwen3, write_prompts

from miles_core import hookimpl
from miles_core.config import validate_config
from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
from miles_core.runtime import Run, train
from miles_core.runtime.control import request

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]

STEPS = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Three loopback nodes of one logical CPU each, and one spare started mid-run."""
    from miles_ray.testing import loopback_cluster

    yield from loopback_cluster(nodes=3, cpus=1, spare=1)


@pytest.fixture(scope="module")
def ray_driver(cluster: Any) -> Iterator[Any]:
    """This process as the cluster's driver."""
    from miles_ray.testing import loopback_driver

    yield from loopback_driver(cluster, log_to_driver=False)


class Elastic:
    """The node joining, the drain and the node lost, each after its step; what each update
    reached."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.run: Run | None = None
        self.new_node = ""
        self.killed = ""
        self.drained = 0
        #: after each update: (step, {engine index: (version, down)})
        self.updates: list[tuple[int, dict[int, tuple[int, bool]]]] = []

    @hookimpl
    def miles_after_train_step(self, step, groups, metrics):
        run = self.run
        assert run is not None and run.fleet is not None
        fleet = run.fleet
        if step == 2:  # the run sees the node at the next step's start: an engine joins
            self.new_node = self.cluster.add_node()
        elif step == 4:
            deadline = time.monotonic() + 180  # engine 2 is up, waiting for the weights
            while not any(e.index == 2 for e in fleet.engines):
                assert time.monotonic() < deadline, "engine 2 did not join within 180 s"
                time.sleep(0.5)
            # the engine on the head node (if one is) is the one drained: a node is killed
            # below, and the head cannot be
            on_head = [i for i in (0, 1) if fleet.launcher.where(i)["address"] == "127.0.0.2"]
            self.drained = on_head[0] if on_head else 0
            request(run.run_dir, {"action": "drain", "engine": self.drained})
        elif step == 6:
            self.killed = fleet.launcher.where(1 - self.drained)["address"]
            self.cluster.kill_node(self.killed)
        elif step == 8:
            # steps are faster than finding engine 1 dead and failing its restart (it waits
            # placement_timeout_s for a node): give that time, not steps
            deadline = time.monotonic() + 180
            while any(e.index == 1 - self.drained for e in fleet.engines):
                assert time.monotonic() < deadline, "engine 1 did not leave within 180 s"
                time.sleep(0.5)

    @hookimpl
    def miles_after_weight_sync(self, step, version, metrics):
        assert self.run is not None and self.run.fleet is not None
        engines = {e.index: (e.version, e.down) for e in self.run.fleet.engines}
        self.updates.append((step, engines))


def test_engines_join_leave_and_survive_a_lost_node(
    ray_driver: Any, cluster: Any, tmp_path: Path
) -> None:
    model = save_tiny_qwen3(tmp_path / "tiny-qwen3", heads=4, kv_heads=2)
    data = write_prompts(tmp_path / "prompts.jsonl", 400)
    ray = {
        "trainer_cpus": 1,
        "placement_timeout_s": 10,
        "ready_timeout_s": 120,
        "join_new_nodes": True,
        "max_engines": 3,
    }
    raw: dict[str, Any] = {
        "run": {
            "name": "elastic",
            "output_dir": str(tmp_path / "runs"),
            "steps": STEPS,
            "mode": "async",
            "placement": "disaggregated",
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1},
        "engine": {
            "name": "embedded",
            "max_running_requests": 4,
            "num_threads": 1,
            "num_engines": 2,
            "launch_in": "ray_actor",
            "ray_num_cpus": 1,
            "dist_timeout": 20,
        },
        "router": None,
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
        "buffer": {"capacity": 4, "max_staleness": 2},
        "plugins": {"options": {"ray": ray}},
    }
    elastic = Elastic(cluster)
    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Diversity(), name="diversity", distribution="test", version="0")
    pm.register_plugin(elastic, name="elastic", distribution="test", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    run = Run(validate_config(raw, plugins.registry), plugins)
    elastic.run = run
    train(run)

    run_dir = tmp_path / "runs" / "elastic"
    assert elastic.new_node == "127.0.0.5" and elastic.killed in ("127.0.0.3", "127.0.0.4")
    # engine 2 joined at step 3, copying a serving engine's weights, and took the update after
    # step 4 at the latest: from then on it serves the trainer's version, with the engines
    # already serving (none paused for it alone)
    by_step = dict(elastic.updates)
    assert 2 not in by_step[2]
    assert by_step[4][2] == (4, False), by_step[4]
    for step in range(5, STEPS + 1):
        assert by_step[step][2] == (step, False), by_step[step]
    assert elastic.drained not in by_step[5]  # drained at step 5
    assert list(by_step[STEPS]) == [2]  # engine 1 left with its node
    outcomes = [json.loads(p.read_text()) for p in sorted((run_dir / "control" / "done").iterdir())]
    assert outcomes == [{"ok": True, "left": elastic.drained}]  # the join was not asked for

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/grad_norm" in r]
    assert [s["weight_version"] for s in steps] == [float(s) for s in range(1, STEPS + 1)]
    for s in steps:
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
        reasons = sum(v for k, v in s.items() if k.startswith("ledger/dropped."))
        assert reasons == s["ledger/dropped"], s
        assert s["staleness/consumed_max"] <= 2
    last = steps[-1]
    assert (last["engine/joined"], last["engine/left"], last["engine/serving"]) == (1, 2, 1)
    assert last["engine/copied_weights"] == 1
    assert last["engine/restarts"] == 1  # engine 1's: tried, and it could not be placed
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
    assert ledger["trained"] == 2 * STEPS
