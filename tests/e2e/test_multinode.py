"""Miles across nodes: a Ray cluster of three nodes on this machine, each at its own loopback
address (127.0.0.2, .3 and .4, each with its own CPUs; started and stopped by this module, by
its own processes). The trainer's ranks are Ray actors, one per rank, meeting over TCP at rank
0's node address; the engines run on their own nodes and bind their node's address.

- trainer world 2 across two nodes and the engine on the third: FSDP2 (sync, broadcast; async,
  p2p), Megatron with its two pipeline stages on two nodes, and Megatron's distributed
  optimizer over two data-parallel ranks on two nodes;
- a checkpoint of two ranks resumed by one: the same state, bitwise, and the run learns on;
- colocated over two nodes: a rank and an engine on each, each engine fed by the rank on its
  node through the colocated transport;
- ``run.json`` says where every process ran; an engine answers at its node's address only;
- a layout larger than the cluster is refused before anything is reserved, naming the nodes.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from core_support import Diversity, save_tiny_qwen3, write_prompts

from miles_core import hookimpl
from miles_core.config import validate_config
from miles_core.data import Group, Sample
from miles_core.errors import MilesUserError
from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
from miles_core.runtime import Run, train

pytestmark = pytest.mark.slow

NODES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
PROMPT = [9707, 11, 1246, 525, 498, 30, 220, 16]  # a fixed prompt of valid Qwen token ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One three-node loopback cluster for the module, 2 logical CPUs a node."""
    from miles_ray.testing import loopback_cluster

    yield from loopback_cluster(nodes=3, cpus=2)


@pytest.fixture(scope="module")
def ray_driver(cluster: Any) -> Iterator[Any]:
    """This process as the cluster's driver."""
    from miles_ray.testing import loopback_driver

    yield from loopback_driver(cluster, log_to_driver=False)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary (2 layers: one a pipeline stage)."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", heads=4, kv_heads=2)


class Probe:
    """After every weight sync: the engine's and the trainer's log-probs of one sequence."""

    def __init__(self, fingerprints: bool = False) -> None:
        self.run: Run | None = None
        self.synced: list[tuple[int, str, float]] = []
        self.fingerprints = fingerprints
        #: the trainer's fingerprint once loaded, and after each step
        self.at_start: dict[str, str] = {}
        self.after_step: list[dict[str, str]] = []

    @hookimpl
    def miles_run_start(self, config, run_dir):
        if self.fingerprints:
            assert self.run is not None and self.run.parts is not None
            self.at_start = self.run.parts.trainer.fingerprint()

    @hookimpl
    def miles_after_train_step(self, step, groups, metrics):
        if self.fingerprints:
            assert self.run is not None and self.run.parts is not None
            self.after_step.append(self.run.parts.trainer.fingerprint())

    @hookimpl
    def miles_after_weight_sync(self, step, version, metrics):
        run = self.run
        assert run is not None and run.parts is not None and run.fleet is not None
        params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        out = run.io(run.fleet.engines[0].client.generate(PROMPT, params))
        sample = Sample(prompt_ids=list(PROMPT))
        sample.append(list(out.output_ids), logprobs=list(out.logprobs), version=version)
        lp, _ = run.parts.trainer.compute_logprobs([Group(samples=[sample])])
        gap = max(abs(float(lp[0, i]) - out.logprobs[i]) for i in range(len(out.output_ids)))
        self.synced.append((version, out.weight_version, gap))


def _raw(tmp_path: Path, model: Path, name: str, **over: Any) -> dict[str, Any]:
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    raw: dict[str, Any] = {
        "run": {
            "name": name,
            "output_dir": str(tmp_path / "runs"),
            "steps": 2,
            "placement": "disaggregated",
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
        "plugins": {"options": {"ray": {"trainer_cpus": 1, "strategy": "STRICT_SPREAD"}}},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def _train(
    raw: dict[str, Any], *, resume: bool = False, fingerprints: bool = False
) -> tuple[Probe, list[dict[str, Any]], dict[str, Any]]:
    probe = Probe(fingerprints)
    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Diversity(), name="diversity", distribution="test", version="0")
    pm.register_plugin(probe, name="probe", distribution="test", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    run = Run(validate_config(raw, plugins.registry), plugins, resume=resume)
    probe.run = run
    t0 = time.perf_counter()
    train(run)
    print(f"{raw['run']['name']}: {time.perf_counter() - t0:.1f} s")
    run_dir = Path(raw["run"]["output_dir"]) / raw["run"]["name"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    placed = json.loads((run_dir / "run.json").read_text())["placement"]
    return probe, rows, placed


def _check_learning_steps(probe: Probe, rows: list[dict[str, Any]]) -> None:
    steps = [r for r in rows if "train/grad_norm" in r]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:
        assert s["train/grad_norm"] > 0 and s["sync/bytes"] > 0
    # after every sync the engine serves exactly the trainer's weights
    assert [(v, w) for v, w, _ in probe.synced] == [(1, "1"), (2, "2")]
    assert all(gap < 1e-4 for _, _, gap in probe.synced), probe.synced


def _by_role(placed: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return sorted((p for p in placed["processes"] if p["role"] == role), key=lambda p: p["index"])


def _check_split(placed: dict[str, Any]) -> None:
    """Two ranks on two nodes, the engine on the third; every URL at its node's address."""
    ranks, engines = _by_role(placed, "trainer_rank"), _by_role(placed, "engine")
    assert [r["index"] for r in ranks] == [0, 1] and len(engines) == 1
    addresses = [r["address"] for r in ranks] + [engines[0]["address"]]
    assert sorted(addresses) == NODES, placed
    assert engines[0]["fed_by"] == 0
    (server,) = placed["servers"]
    assert server["address"] == engines[0]["address"]


@pytest.mark.parametrize(
    ("mode", "transport"), [("sync", "broadcast"), ("async", "p2p")], ids=["sync", "async-p2p"]
)
def test_fsdp2_world_two_across_nodes(
    ray_driver: Any, tiny_qwen3: Path, tmp_path: Path, mode: str, transport: str
) -> None:
    raw = _raw(
        tmp_path,
        tiny_qwen3,
        f"fsdp2-{mode}",
        run={"mode": mode},
        transport={"name": transport},
    )
    if mode == "async":
        raw["algorithm"]["behaviour_policy"] = "rollout"
    probe, rows, placed = _train(raw)
    _check_learning_steps(probe, rows)
    _check_split(placed)


def test_resume_at_another_world_size(ray_driver: Any, tiny_qwen3: Path, tmp_path: Path) -> None:
    # one step with two ranks on two nodes, checkpointed at its end ...
    raw = _raw(tmp_path, tiny_qwen3, "reshard", run={"steps": 1})
    first, _, placed = _train(raw, fingerprints=True)
    assert len(_by_role(placed, "trainer_rank")) == 2
    # ... resumed by one rank: the same weights and optimizer state, bitwise, then it learns on
    raw = _raw(tmp_path, tiny_qwen3, "reshard", run={"steps": 2}, backend={"world_size": 1})
    second, rows, placed = _train(raw, resume=True, fingerprints=True)
    assert len(_by_role(placed, "trainer_rank")) == 1
    assert second.at_start == first.after_step[-1]
    steps = [r for r in rows if "train/grad_norm" in r]
    assert [s["weight_version"] for s in steps][-1] == 2.0 and steps[-1]["train/grad_norm"] > 0
    assert second.synced[-1][:2] == (2, "2") and second.synced[-1][2] < 1e-4


@pytest.mark.parametrize(
    "layout",
    [{"pipeline_parallel": 2}, {"data_parallel": 2, "distributed_optimizer": True}],
    ids=["pp2", "dp2-distributed-optimizer"],
)
def test_megatron_across_two_nodes(
    ray_driver: Any, tiny_qwen3: Path, tmp_path: Path, layout: dict[str, Any]
) -> None:
    raw = _raw(tmp_path, tiny_qwen3, "megatron")
    # its world size: tensor x pipeline x data parallel
    raw["backend"] = {"name": "megatron", "lr": 1e-2, "cpu_threads": 1, **layout}
    probe, rows, placed = _train(raw)
    _check_learning_steps(probe, rows)
    _check_split(placed)


def test_colocated_per_node(ray_driver: Any, tiny_qwen3: Path, tmp_path: Path) -> None:
    raw = _raw(
        tmp_path,
        tiny_qwen3,
        "colocated",
        run={"placement": "colocated"},
        engine={"num_engines": 2},
        transport={"name": "colocated"},
        plugins={"options": {"ray": {"trainer_cpus": 1, "nodes": 2}}},
    )
    probe, rows, placed = _train(raw)
    _check_learning_steps(probe, rows)
    ranks, engines = _by_role(placed, "trainer_rank"), _by_role(placed, "engine")
    # a rank and an engine on each of two nodes; each engine fed by the rank on its node
    assert len({r["address"] for r in ranks}) == 2
    for engine in engines:
        feeder = ranks[engine["fed_by"]]
        assert feeder["address"] == engine["address"] and feeder["bundle"] == engine["bundle"]
    assert {e["address"] for e in engines} == {r["address"] for r in ranks}
    # the ranks' colocated buckets lived in torch's shared memory; their manager ended with
    # the actors, and the release removed the files (each about a bucket)
    left = [n for r in ranks for n in os.listdir("/dev/shm") if n.startswith(f"torch_{r['pid']}_")]
    assert left == [], left
    # every engine URL is its node's address; the server answers there and only there
    for server in (s for s in placed["servers"] if s["role"] == "engine"):
        host = urlsplit(server["url"]).hostname
        assert host == engines[server["index"]]["address"]
    _check_bound_to_node(ray_driver, tiny_qwen3)


def _check_bound_to_node(ray: Any, model: Path) -> None:
    """An engine started on 127.0.0.4 binds that address alone: 127.0.0.1 at its port is
    refused."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    (node,) = [n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == "127.0.0.4"]
    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1, num_threads=1))
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    launcher.place_engines(lambda i: {"num_cpus": 1, "scheduling_strategy": strategy})
    try:
        url = launcher.launch(str(model), index=0)
        parts = urlsplit(url)
        assert parts.hostname == "127.0.0.4"
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            assert resp.status == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", parts.port), timeout=5).close()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{parts.port}/health", timeout=5)
    finally:
        launcher.shutdown()


def test_a_layout_larger_than_the_cluster_is_refused(
    ray_driver: Any, tiny_qwen3: Path, tmp_path: Path
) -> None:
    # three ranks and an engine, each on its own node: four bundles, three nodes
    raw = _raw(tmp_path, tiny_qwen3, "too-big", backend={"world_size": 3})
    t0 = time.monotonic()
    with pytest.raises(MilesUserError) as err:
        _train(raw)
    text = str(err.value)
    assert "STRICT_SPREAD puts each of its 4 bundles on its own node" in text, text
    assert all(node in text for node in NODES) and "world_size" in text
    assert time.monotonic() - t0 < 60  # refused before any reservation waits
    # a bundle larger than any node
    raw = _raw(tmp_path, tiny_qwen3, "too-big-bundle")
    raw["plugins"]["options"]["ray"]["trainer_cpus"] = 3
    with pytest.raises(MilesUserError, match=r"bundle 0 \{'CPU': 3.0\} fits no node"):
        _train(raw)
