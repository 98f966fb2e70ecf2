"""A trainer node lost: a three-node loopback Ray cluster, the trainer's two ranks on two nodes
and the engine on the third. After step 3 the node of a rank (not the head's) is killed, every
process of it: the run stops with an error naming the rank, keeping its step-2 checkpoint,
metrics and ledger. ``--resume`` on the two nodes that remain, at world size 1 (the checkpoint
reshards), finishes the run from step 3."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import Diversity, save_tiny_qwen3, write_prompts

from miles_core import hookimpl
from miles_core.config import validate_config
from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
from miles_core.runtime import Run, train

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]

STEPS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Three loopback nodes of one logical CPU each."""
    from miles_ray.testing import loopback_cluster

    yield from loopback_cluster(nodes=3, cpus=1)


@pytest.fixture(scope="module")
def ray_driver(cluster: Any) -> Iterator[Any]:
    """This process as the cluster's driver."""
    from miles_ray.testing import loopback_driver

    yield from loopback_driver(cluster, log_to_driver=False)


class NodeKiller:
    """After step 3: kill the node of the trainer rank that is not on the head node."""

    def __init__(self, cluster: Any, run_dir: Path) -> None:
        self.cluster, self.run_dir = cluster, run_dir
        self.killed: tuple[int, str] | None = None
        self.status = ""

    @hookimpl
    def miles_run_end(self, config, run_dir, status):
        self.status = status

    @hookimpl
    def miles_after_train_step(self, step, groups, metrics):
        if step != 3 or self.killed is not None:
            return
        placed = json.loads((self.run_dir / "run.json").read_text())["placement"]["processes"]
        head = self.cluster.head_address
        rank, address = next(
            (p["index"], p["address"])
            for p in placed
            if p["role"] == "trainer_rank" and p["address"] != head
        )
        self.killed = (rank, address)
        self.cluster.kill_node(address)


def _run(raw: dict[str, Any], killer: NodeKiller | None, *, resume: bool) -> Run:
    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Diversity(), name="diversity", distribution="test", version="0")
    if killer is not None:
        pm.register_plugin(killer, name="killer", distribution="test", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    return Run(validate_config(raw, plugins.registry), plugins, resume=resume)


def test_a_lost_trainer_node_stops_the_run_and_resume_finishes_it_on_the_rest(
    ray_driver: Any, cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_tiny_qwen3(tmp_path / "tiny-qwen3", heads=4, kv_heads=2)
    data = write_prompts(tmp_path / "prompts.jsonl", 200)
    ray = {"trainer_cpus": 1, "strategy": "STRICT_SPREAD", "ready_timeout_s": 120}
    raw: dict[str, Any] = {
        "run": {
            "name": "lost",
            "output_dir": str(tmp_path / "runs"),
            "steps": STEPS,
            "placement": "disaggregated",
            "checkpoint_every": 2,
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1, "world_size": 2},
        "engine": {
            "name": "embedded",
            "max_running_requests": 8,
            "num_threads": 1,
            "launch_in": "ray_actor",
            "ray_num_cpus": 1,
        },
        "algorithm": {"name": "grpo"},
        "transport": {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 4},
        "plugins": {"options": {"ray": ray}},
    }
    run_dir = tmp_path / "runs" / "lost"
    killer = NodeKiller(cluster, run_dir)
    with pytest.raises(Exception) as failed:
        train(_run(raw, killer, resume=False))
    assert killer.killed is not None
    rank, address = killer.killed
    assert f"rank {rank}" in str(failed.value) or f"ranks [{rank}]" in str(failed.value), str(
        failed.value
    )
    assert (run_dir / "checkpoints" / "step_2" / "loop.json").is_file()
    assert not (run_dir / "checkpoints" / "step_4").exists()
    assert killer.status == "failed"
    said = capsys.readouterr().err
    # in step 3's weight update or step 4's training, whichever first meets the dead rank
    assert re.search(r"the run stopped at step [34]: .*rank \d", said), said
    assert "its last checkpoint is step_2: `miles train <config> --resume`" in said, said
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "ledger.json").is_file()

    # the same run on the nodes that remain, one rank: resumed from step 2, finished
    raw["backend"]["world_size"] = 1
    raw["plugins"]["options"]["ray"]["strategy"] = "PACK"
    summary = train(_run(raw, None, resume=True))
    # the held-out accuracy before training, evaluated by the run that was stopped, is kept
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r["eval/accuracy"] for r in evals if "eval/accuracy" in r and r["step"] == 0)
    assert summary["accuracy_before"] == first
    history = json.loads((run_dir / "eval.json").read_text())["history"]
    assert [step for step, _ in history] == [0, STEPS]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "train/grad_norm" in r}
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(steps[s]["weight_version"] == s for s in steps)
    placed = json.loads((run_dir / "run.json").read_text())["placement"]["processes"]
    assert address not in {p["address"] for p in placed}
    assert sum(p["role"] == "trainer_rank" for p in placed) == 1
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["trained"] == 2 * STEPS
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
