"""A Ray cluster of three nodes on this machine, each at its own loopback address (127.0.0.2,
.3, .4): placement groups and node affinity see three distinct node addresses, a second
cluster runs beside it on ports of its own, and a stop ends every process of a cluster and no
other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
from miles_ray.cluster import ClusterStartError, LoopbackCluster
from miles_ray.cluster_host import (
    NODE_PORTS,
    claim_ports,
    claimed_blocks,
    is_running,
    release_ports,
    session_members,
)
from miles_ray.testing import loopback_cluster, loopback_driver

ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    yield from loopback_cluster(nodes=3, cpus=2)


@pytest.fixture(scope="module")
def ray_driver(cluster: LoopbackCluster) -> Iterator[ModuleType]:
    before = {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")}
    yield from loopback_driver(cluster, log_to_driver=False)
    # the cluster's token was in this process's environment only while it was connected
    assert {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")} == before


class Where:
    """An actor that says where it runs: its node's address and its pid."""

    def where(self) -> tuple[str, int]:
        import ray

        return str(ray.util.get_node_ip_address()), os.getpid()  # type: ignore[no-untyped-call]


def _where(ray: ModuleType, actors: list[object]) -> list[tuple[str, int]]:
    return [tuple(w) for w in ray.get([a.where.remote() for a in actors], timeout=60)]  # type: ignore[attr-defined]


@pytest.mark.slow
def test_three_nodes_at_three_loopback_addresses(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    ray = ray_driver
    assert cluster.node_addresses == ADDRESSES
    assert cluster.address == f"127.0.0.2:{cluster.address.split(':')[1]}"
    assert int(cluster.address.split(":")[1]) in cluster.port_range
    alive = {n["NodeManagerAddress"]: n for n in ray.nodes() if n["Alive"]}
    assert sorted(alive) == ADDRESSES
    assert all(n["Resources"]["CPU"] == 2 for n in alive.values())
    # the driver runs at 127.0.0.1, on none of the nodes, attached to the head's raylet
    assert ray.get_runtime_context().get_node_id() == alive["127.0.0.2"]["NodeID"]
    with pytest.raises(RuntimeError, match="initialised in this process already"):
        with cluster.connect():
            pass


def _command_lines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass  # ended meanwhile
    return lines


@pytest.mark.slow
def test_the_nodes_run_no_idle_workers_log_monitor_or_autoscaler(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    # Ray would start a worker a CPU when the first driver joins (a driver is connected here),
    # and a log monitor and the autoscaler's monitor with each node: none of them does
    # anything for a cluster of fixed nodes whose drivers take no logs, and on a machine of a
    # few cores they take CPU from what runs beside them.
    deadline = time.monotonic() + 4
    while True:
        lines = [c for pids in cluster.processes().values() for c in _command_lines(pids)]
        assert lines, "no process of the cluster was found"
        # a worker not yet named, or the program a Python runs (the raylet's own command line
        # names the worker's program as an argument)
        unwanted = [
            c
            for c in lines
            if c.startswith("ray::IDLE")
            or any(
                arg.endswith(
                    ("default_worker.py", "log_monitor.py", "autoscaler/_private/monitor.py")
                )
                for arg in c.split()[:3]
            )
        ]
        assert not unwanted, unwanted
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)


@pytest.mark.slow
def test_strict_spread_puts_one_bundle_on_each_node(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = ray_driver
    group = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    actor = ray.remote(num_cpus=1)(Where)
    actors = [
        actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i
            )
        ).remote()
        for i in range(3)
    ]
    try:
        where = _where(ray, actors)
        assert sorted(address for address, _ in where) == ADDRESSES
        # each actor is a process of its node's session: the cluster knows it, and stops it
        processes = cluster.processes()
        assert all(pid in processes[address] for address, pid in where)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(group)


@pytest.mark.slow
def test_an_actor_pinned_to_a_node_runs_there(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray = ray_driver
    node_id = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == "127.0.0.4")
    by_id = ray.remote(num_cpus=1)(Where).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    by_resource = ray.remote(num_cpus=1, resources={"node:127.0.0.4": 0.01})(Where)
    actors = [by_id.remote(), by_resource.remote()]
    try:
        assert [address for address, _ in _where(ray, actors)] == ["127.0.0.4"] * 2
    finally:
        for a in actors:
            ray.kill(a)


@pytest.mark.slow
def test_a_second_cluster_beside_it_has_its_own_ports_and_its_stop_ends_only_its_own(
    cluster: LoopbackCluster, ray_driver: ModuleType
) -> None:
    ray = ray_driver
    leaders = cluster.sessions
    began = time.monotonic()
    with LoopbackCluster(nodes=2, cpus=1) as second:
        started = time.monotonic() - began
        assert not set(second.port_range) & set(cluster.port_range)
        assert second.address != cluster.address
        mine = [p for pids in second.processes().values() for p in pids]
        assert set(second.sessions.values()) <= set(mine)
        assert not set(mine) & {p for pids in cluster.processes().values() for p in pids}
        ranges = [(r.start, r.stop) for r in (second.port_range, cluster.port_range)]
        assert set(ranges) <= set(claimed_blocks())
        # a driver in another process joins with the cluster's environment
        code = (
            "import ray; ray.init(log_to_driver=False); "
            "print(sorted(n['NodeManagerAddress'] for n in ray.nodes()))"
        )
        env = {**os.environ, **second.driver_env()}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.stdout.strip().splitlines()[-1:] == [str(ADDRESSES[:2])], out.stderr[-2000:]
        began = time.monotonic()
    stopped = time.monotonic() - began
    print(f"a 2-node cluster beside a 3-node one: start {started:.1f} s, stop {stopped:.1f} s")
    assert set(mine) <= set(second.stopped_pids)
    assert not [p for p in second.stopped_pids if is_running(p)]
    assert (ranges[0] not in claimed_blocks()) and ranges[1] in claimed_blocks()
    # the first cluster is untouched: its nodes run and all three still answer
    assert all(is_running(sid) for sid in leaders.values())
    assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == ADDRESSES
    assert ray.get(ray.remote(lambda: 1 + 1).remote(), timeout=60) == 2


@pytest.mark.slow
def test_a_cluster_that_does_not_come_up_in_time_is_stopped_with_its_logs_in_the_error() -> None:
    attempt = LoopbackCluster(nodes=2, cpus=1, start_timeout_s=0.3)
    with pytest.raises(
        ClusterStartError, match=r"(?s)(within|did not listen).*--- node 127\.0\.0\.2"
    ):
        attempt.start()
    assert attempt.stopped_pids, "the nodes' processes were recorded"
    assert not [p for p in attempt.stopped_pids if is_running(p)]


OWNER = """
import json, sys, time
from miles_ray.cluster import LoopbackCluster
cluster = LoopbackCluster(nodes=2, cpus=1)
cluster.start()
print(json.dumps({"sessions": list(cluster.sessions.values()), "temp": str(cluster.temp_dir)}))
sys.stdout.flush()
time.sleep(600)
"""


@pytest.mark.slow
def test_a_cluster_whose_owner_is_killed_is_ended_by_its_watchdog() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        processes = [p for sid in started["sessions"] for p in session_members(sid)]
        assert len(started["sessions"]) == 2 and processes
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while any(is_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in processes if is_running(p)]
    while os.path.exists(started["temp"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(started["temp"])


def test_port_blocks_never_overlap_and_the_block_of_a_process_gone_is_free_again() -> None:
    a = claim_ports(3 * NODE_PORTS)
    b = claim_ports(3 * NODE_PORTS)
    try:
        assert a + 3 * NODE_PORTS <= b or b + 3 * NODE_PORTS <= a
        assert {(a, a + 3 * NODE_PORTS), (b, b + 3 * NODE_PORTS)} <= set(claimed_blocks())
        code = "from miles_ray.cluster_host import claim_ports; print(claim_ports(128))"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        gone = int(out.stdout)
        assert gone not in (a, b)
        assert gone not in [start for start, _ in claimed_blocks()]
    finally:
        release_ports(a)
        release_ports(b)
    assert not {a, b} & {start for start, _ in claimed_blocks()}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodes": 0}, "nodes: 0 is not allowed"),
        ({"nodes": 17}, "nodes: 17 is not allowed"),
        ({"nodes": 3, "cpus": [1, 2]}, "cpus: 2 values for 3 nodes"),
        ({"cpus": -1}, "cpus: -1 is not allowed"),
        ({"gpus": 1.5}, "gpus: 1.5 is not allowed"),
        ({"resources": {"disk": -1}}, "resources: .* is not allowed"),
        ({"object_store_mb": 10}, "object_store_mb: 10 is not allowed"),
        ({"temp_root": "/" + "x" * 60}, "temp_root: .* is too long"),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LoopbackCluster(**options)  # type: ignore[arg-type]
