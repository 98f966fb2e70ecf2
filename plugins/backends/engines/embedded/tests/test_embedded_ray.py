"""The embedded engine started from a Ray actor on a real local Ray cluster."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from miles_engine_embedded.launcher import build
from miles_engine_embedded.plugin import EmbeddedEngineConfig

pytestmark = pytest.mark.slow


def test_engine_runs_inside_a_ray_actor(tiny_model: Path) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.1.1")
    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1, num_threads=1))
    try:
        url = launcher.launch(str(tiny_model), index=0)
        actor_pid, server_pid = launcher.pids(0)
        assert actor_pid != os.getpid()  # the server belongs to the actor's process
        # its parent: the actor (not a fork server: Ray stops an actor's children with it)
        assert _parent(server_pid) == actor_pid

        async def generate() -> list[int]:
            client = launcher.client(url)
            try:
                out = await client.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
                return list(out.output_ids)
            finally:
                await client.close()

        assert len(asyncio.run(generate())) == 4
        launcher.shutdown()
        assert not os.path.exists(f"/proc/{server_pid}") or _zombie(server_pid)
    finally:
        launcher.shutdown()
        ray.shutdown()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
