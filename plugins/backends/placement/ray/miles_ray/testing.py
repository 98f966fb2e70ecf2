"""Test fixtures for a run across nodes: a :class:`~miles_ray.cluster.LoopbackCluster` per test
module, and a driver joined to it.

```python
import pytest
from miles_ray.testing import loopback_cluster, loopback_driver


@pytest.fixture(scope="module")
def cluster():
    yield from loopback_cluster(nodes=3, cpus=2)


@pytest.fixture(scope="module")
def ray_driver(cluster):
    yield from loopback_driver(cluster, log_to_driver=False)
```

A machine that lacks what the cluster needs skips the module's tests with a reason that starts
with ``host:`` (see CONTRIBUTING.md, strict skips); any other failure to start is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

from miles_ray.cluster import HostUnfitError, LoopbackCluster
from miles_ray.cluster_host import is_running


def loopback_cluster(nodes: int = 3, cpus: int = 2, **options: Any) -> Iterator[LoopbackCluster]:
    """A started cluster of ``nodes`` nodes with ``cpus`` logical CPUs each (``options``: the
    rest of :class:`LoopbackCluster`'s), stopped after the fixture's scope; the stop is checked:
    a process of the cluster still running after it fails the teardown."""
    import pytest

    cluster = LoopbackCluster(nodes, cpus, **options)
    try:
        cluster.start()
    except HostUnfitError as e:
        pytest.skip(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()
        left = [p for p in cluster.stopped_pids if is_running(p)]
        assert not left, f"processes of the loopback cluster outlived its stop: {left}"


def loopback_driver(cluster: LoopbackCluster, **init_kwargs: Any) -> Iterator[ModuleType]:
    """This process as a driver of ``cluster`` (``ray`` after ``ray.init(**init_kwargs)``),
    disconnected after the fixture's scope."""
    with cluster.connect(**init_kwargs) as ray:
        yield ray
