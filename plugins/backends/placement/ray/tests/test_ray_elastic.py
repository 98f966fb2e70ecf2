"""Nodes and engines that join and leave a running job, on a loopback Ray cluster of two nodes
with two spare ones: a spare node joins and takes work only it can hold, then is lost (killed
at once) and seen dead within the health-check time; an engine beyond a disaggregated run's
plan waits a bounded time for a node with room, fails naming what it needs, and once a node
joins starts there."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import pytest
from miles_ray.cluster import LoopbackCluster
from miles_ray.cluster_host import is_running
from miles_ray.layout import plan
from miles_ray.options import RayOptions
from miles_ray.placement import RayPlacement
from miles_ray.testing import loopback_cluster, loopback_driver

pytestmark = pytest.mark.slow

#: the spare nodes: 127.0.0.4 has a resource of its own, 127.0.0.5 a CPU for an engine
SPARE_RESOURCES = [{}, {}, {"joined": 1.0}, {}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    yield from loopback_cluster(nodes=2, cpus=1, spare=2, resources=SPARE_RESOURCES)


@pytest.fixture(scope="module")
def ray_driver(cluster: LoopbackCluster) -> Iterator[ModuleType]:
    yield from loopback_driver(cluster, log_to_driver=False)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary size."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("model") / "tiny-qwen3"
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _alive(ray: ModuleType) -> set[str]:
    return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def _node_of_task(ray: ModuleType, **options: object) -> str:
    def where() -> str:
        import ray as inner

        return str(inner.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    return str(ray.get(ray.remote(**options)(where).remote(), timeout=60))


def test_a_spare_node_joins_takes_its_work_and_is_seen_dead_once_killed(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    ray = ray_driver
    assert cluster.spare_addresses[0] == "127.0.0.4"
    assert _alive(ray) == {"127.0.0.2", "127.0.0.3"}
    # no node has the resource yet: a task that needs it waits
    waiting = ray.remote(num_cpus=0, resources={"joined": 1})(lambda: 1).remote()
    assert ray.wait([waiting], timeout=1)[0] == []
    ray.cancel(waiting)

    began = time.monotonic()
    address = cluster.add_node()
    print(f"a node joined in {time.monotonic() - began:.1f} s")
    assert address == "127.0.0.4" and "127.0.0.4" not in cluster.spare_addresses
    assert cluster.node_addresses[-1] == address and _alive(ray) >= {address}
    assert _node_of_task(ray, num_cpus=0, resources={"joined": 1}) == address
    # the node's processes are the cluster's own: its port block, its session
    processes = cluster.processes()[address]
    assert processes

    killed = cluster.kill_node(address)
    began = time.monotonic()
    assert set(processes) <= set(killed) <= set(cluster.stopped_pids)
    assert not [p for p in killed if is_running(p)]
    assert address not in cluster.node_addresses
    while address in _alive(ray) and time.monotonic() - began < 30:
        time.sleep(0.2)
    dead_after = time.monotonic() - began
    print(f"the killed node was seen dead after {dead_after:.1f} s")
    assert address not in _alive(ray), "the killed node is still alive after 30 s"
    assert dead_after < 20  # 5 health checks 1 s apart, not Ray's default 15 s and more
    assert _alive(ray) == {"127.0.0.2", "127.0.0.3"}
    with pytest.raises(ValueError, match=r"address: no node up at '127\.0\.0\.4'"):
        cluster.kill_node(address)
    with pytest.raises(ValueError, match="is the head"):
        cluster.kill_node(cluster.head_address)


def _health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        return int(response.status)


def test_an_engine_beyond_the_plan_starts_on_a_node_that_joined(
    cluster: LoopbackCluster, ray_driver: ModuleType, tiny_qwen3: Path
) -> None:
    from miles_engine_embedded.launcher import EngineStartError, build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    ray = ray_driver
    engine = EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1, num_threads=1)
    launcher = build(engine)
    # a disaggregated run of one rank and one engine: its two bundles fill both nodes' CPUs
    layout = plan("disaggregated", {"CPU": 1}, launcher.engine_resources(), engine.num_engines)
    placement = RayPlacement(layout, RayOptions(placement_timeout_s=5))
    placement._reserve("joins")
    launcher.place_engines(placement.engine_actor_options, placement.options.placement_timeout_s)
    placement.launcher = launcher
    joined = engine.num_engines
    try:
        assert ray.available_resources().get("CPU", 0) == 0
        # no node has room: the joining engine fails in bounded time, naming what it needs
        began = time.monotonic()
        with pytest.raises(EngineStartError) as err:
            launcher.launch(str(tiny_qwen3), index=joined)
        waited = time.monotonic() - began
        assert f"engine {joined}'s Ray actor was not placed within 5 s" in str(err.value)
        assert "no alive node could take {CPU: 1, GPU: 0}" in str(err.value)
        assert waited < 20 and joined not in launcher.actors

        address = cluster.add_node()
        url = launcher.launch(str(tiny_qwen3), index=joined)
        where = launcher.where(joined)
        assert where["address"] == address == urlsplit(url).hostname
        assert not where["placement_group_id"]  # no bundle: placed wherever there was room
        assert _health(url) == 200
        (row,) = [r for r in placement.record() if r["role"] == "engine"]
        assert (row["index"], row["bundle"], row["fed_by"]) == (joined, None, 0)
        assert row["address"] == address
    finally:
        launcher.shutdown()
        placement.release()
    assert launcher.actors == {} and launcher.urls == {}


def test_an_engine_cannot_join_a_colocated_run(ray_driver: ModuleType, tiny_qwen3: Path) -> None:
    from miles_engine_embedded.launcher import EngineStartError, build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1))
    layout = plan("colocated", {"CPU": 1}, launcher.engine_resources(), 1)
    launcher.place_engines(RayPlacement(layout, RayOptions()).engine_actor_options)
    with pytest.raises(EngineStartError, match=r"engine 1 cannot be placed: .*'colocated'"):
        launcher.launch(str(tiny_qwen3), index=1)
    assert launcher.actors == {}
