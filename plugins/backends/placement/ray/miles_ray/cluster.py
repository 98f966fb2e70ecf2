"""A Ray cluster of several nodes on this one machine, each node at its own loopback address
(the head at 127.0.0.2, the others at 127.0.0.3, 127.0.0.4, ...), for tests and benchmarks of
a run across nodes.

Each node is a ``ray start --block`` process in a session of its own: every process Ray starts
for that node (the GCS, the raylet, the agents, the workers, which Ray moves into process
groups of their own) stays in that session, so the cluster knows exactly which processes are
its own and stops only those — never with ``ray stop``, which ends every Ray process on the
machine. Linux only (the sessions are read from ``/proc``). Should the process that started
the cluster end without stopping it (killed, crashed), a watchdog process ends the nodes: it
waits on a pipe that only that process holds open.

Two clusters on one machine (two test modules under pytest-xdist) never share a port: each
claims a block of ports (:mod:`miles_ray.cluster_host`), and every port Ray opens on a node is
set within that node's part of the block.

The nodes require a token (Ray's token authentication, a fresh random token per cluster): the
GCS and the raylets listen on every interface, not only on the loopback. A driver joins with
:meth:`LoopbackCluster.connect`, or in another process with the environment of
:meth:`LoopbackCluster.driver_env`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

from miles_ray.cluster_host import (
    NODE_PORTS,
    ClusterStartError,
    HostUnfitError,
    NodePorts,
    accepts,
    check_bindable,
    claim_ports,
    end_sessions,
    hold_ports,
    is_running,
    kill_sessions,
    log_tail,
    release_ports,
    session_members,
)
from miles_ray.cluster_nodes import (
    Node,
    check_sizes,
    environment,
    node_resources,
    ray_start_args,
    run_probe,
    tell_watchdog,
)

__all__ = ["ClusterStartError", "HostUnfitError", "LoopbackCluster"]

#: the head is 127.0.0.2 (127.0.0.1 stays the address of the drivers and of everything else)
FIRST_HOST = 2
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_HEALTH_CHECK = {
    "initial_delay_ms": "1000",
    "period_ms": "1000",
    "timeout_ms": "3000",
    "failure_threshold": "5",
}
#: Ray's settings of every node: the GCS marks a node that stops answering dead after 5 checks
#: 1 s apart (Ray's default: 3 s apart, after 5 s), so a killed node is seen dead within
#: seconds; no worker starts before an actor or a task needs one (Ray would start one a CPU when
#: the first driver joins, and the start's own probe is one)
_NODE_CONFIG = {
    **{f"RAY_health_check_{k}": v for k, v in _HEALTH_CHECK.items()},
    "RAY_prestart_worker_first_driver": "false",
    "RAY_enable_worker_prestart": "false",
}


def _address(index: int) -> str:
    return f"127.0.0.{FIRST_HOST + index}"


class LoopbackCluster:
    """A Ray cluster of ``nodes`` nodes on this machine: the head at 127.0.0.2, the others at
    127.0.0.3, 127.0.0.4, ...; a context manager that starts it and waits until every node is
    alive, and stops it (every process of it, none other) and removes its files on exit.

    ``spare`` more nodes have their addresses and ports set aside but are not started: each
    :meth:`add_node` starts the next one (a node joining the running cluster), and
    :meth:`kill_node` ends a worker node at once, as a machine lost. ``cpus`` / ``gpus``
    (logical, Ray's accounting) and ``resources`` (custom resources) are one value for every
    node or one per node, spare ones included; ``gpus`` defaults to 0, so that on a machine
    with GPUs the nodes do not each claim all of them. ``object_store_mb`` is each node's
    object store (Ray's minimum is 75). The nodes run no autoscaler, start no Ray worker ahead
    of need, and run Ray's log monitor (for drivers with ``log_to_driver``) if ``log_monitor``.

    A driver in this process joins with ``with cluster.connect(log_to_driver=False) as ray:``,
    which is ``ray.init(address=cluster.address, _node_ip_address=cluster.head_address)`` with
    the cluster's token in ``RAY_AUTH_MODE=token`` / ``RAY_AUTH_TOKEN`` (and the previous
    values put back after ``ray.shutdown()``). The token is required: an explicit address
    never picks a token up by itself. ``_node_ip_address`` attaches the driver, which runs at
    127.0.0.1 (on none of the nodes), to the head's raylet; without it Ray 2.60 also picks
    the head among the raylets found on this host. A driver in another process runs with
    :meth:`driver_env` in its environment and calls ``ray.init()``.
    """

    def __init__(
        self,
        nodes: int = 3,
        cpus: int | Sequence[int] = 2,
        gpus: int | Sequence[int] = 0,
        resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
        object_store_mb: int = 80,
        start_timeout_s: float = 120.0,
        stop_grace_s: float = 15.0,
        temp_root: str | None = None,
        spare: int = 0,
        log_monitor: bool = False,
    ) -> None:
        root = temp_root or tempfile.gettempdir()
        check_sizes(nodes, spare, object_store_mb, start_timeout_s, stop_grace_s, root)
        self.cpus, self.gpus, self.resources = node_resources(cpus, gpus, resources, nodes + spare)
        self.size = nodes
        self.spare = spare
        #: the nodes up (started, not killed), by index: the planned ones until start
        self._up: list[int] = list(range(nodes))
        self.object_store_mb = object_store_mb
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.temp_root = root
        self.log_monitor = log_monitor
        self._token = secrets.token_hex(32)
        self._nodes: list[Node] = []
        self._port_start: int | None = None
        self._temp: Path | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.stopped_pids: list[int] = []

    # --- addresses ----------------------------------------------------------------------------

    @property
    def node_addresses(self) -> list[str]:
        """The address of every node up (started and not killed), the head's first."""
        return [_address(i) for i in self._up]

    @property
    def spare_addresses(self) -> list[str]:
        """The addresses of the spare nodes not started yet, in the order they start."""
        started = {n.index for n in self._nodes if n.process is not None}
        total = range(self.size + self.spare)
        return [_address(i) for i in total if i not in started and i not in self._up]

    @property
    def head_address(self) -> str:
        """The head node's address."""
        return _address(0)

    @property
    def address(self) -> str:
        """The cluster's address (``host:port`` of the head's GCS), as ``ray.init`` takes it."""
        if not self._nodes:
            raise RuntimeError("the cluster is not started")
        return f"{self.head_address}:{self._nodes[0].ports.gcs}"

    @property
    def temp_dir(self) -> Path | None:
        """The folder of the nodes' files (Ray's logs and sockets), removed at stop."""
        return self._temp

    @property
    def port_range(self) -> range:
        """The ports claimed for the cluster (every port its nodes open lies in it)."""
        if self._port_start is None:
            raise RuntimeError("the cluster is not started")
        return range(self._port_start, self._port_start + (self.size + self.spare) * NODE_PORTS)

    def driver_env(self) -> dict[str, str]:
        """The environment a driver in another process needs to join: ``RAY_ADDRESS`` and the
        cluster's token (``RAY_AUTH_TOKEN`` wins over a ``RAY_AUTH_TOKEN_PATH`` there)."""
        return {"RAY_ADDRESS": self.address, **self._auth_env()}

    def _auth_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self._token}

    # --- start --------------------------------------------------------------------------------

    def __enter__(self) -> LoopbackCluster:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every node and wait until all are alive (else stop them and raise
        :class:`ClusterStartError`)."""
        if self._nodes:
            raise RuntimeError("the cluster is started already")
        if sys.platform != "linux":
            raise HostUnfitError("host: a loopback cluster needs Linux's /proc")
        total = self.size + self.spare
        for i in range(total):
            check_bindable(_address(i))
        self._port_start = claim_ports(total * NODE_PORTS)
        self._temp = Path(tempfile.mkdtemp(prefix="mlr", dir=self.temp_root))
        self._nodes = [
            Node(i, _address(i), NodePorts(self._port_start + i * NODE_PORTS), self._temp / f"n{i}")
            for i in range(total)
        ]
        try:
            for node in self._nodes[: self.size]:
                self._launch(node)
            sids = [str(n.sid) for n in self._nodes if n.sid is not None]
            hold_ports(self._port_start, [int(s) for s in sids])
            # ends the nodes should this process end without stopping them: its stdin closes
            watch = ["-m", "miles_ray.cluster_host", str(self.stop_grace_s), str(self._temp)]
            self._watchdog = subprocess.Popen(
                [sys.executable, *watch, *sids], stdin=subprocess.PIPE, start_new_session=True
            )
            self.wait_alive(self.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _node_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *_AUTH_VARS)}
        # SIGTERM ends a node at once instead of draining it for 30 s first
        env.update(self._auth_env(), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
        env.update(_NODE_CONFIG)
        return env

    def _launch(self, node: Node) -> None:
        i = node.index
        res = (self.cpus[i], self.gpus[i], self.object_store_mb, self.resources[i])
        head = None if i == 0 else self.address
        node.start(ray_start_args(node, *res, head, self.log_monitor), self._node_env())

    def wait_alive(self, timeout_s: float = 120.0) -> list[str]:
        """Wait until every node is alive in the cluster (asked from a short-lived driver in a
        process of its own); the nodes' addresses. Raises :class:`ClusterStartError` with each
        node's log tail when a node exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        gcs = (self.head_address, self._nodes[0].ports.gcs)
        while not accepts(*gcs):
            self._check_nodes_run()
            if time.monotonic() > deadline:
                raise self._start_error(f"the head's GCS did not listen on {gcs[0]}:{gcs[1]}")
            time.sleep(0.2)
        try:
            code, out = run_probe(
                self.address, self.node_addresses, deadline, self._node_env(), self._check_nodes_run
            )
        except TimeoutError:
            raise self._start_error("the probe of the nodes did not answer") from None
        last = out.strip().splitlines()[-1:] or [""]
        if code != 0:
            raise self._start_error(
                f"not every node was alive within {timeout_s:.0f} s: {last[0]}\n{out[-2000:]}"
            )
        return list(json.loads(last[0])["alive"])

    def _check_nodes_run(self) -> None:
        for node in (self._nodes[i] for i in self._up):
            if node.process is not None and node.process.poll() is not None:
                raise self._start_error(
                    f"node {node.address} exited with {node.process.returncode}"
                )

    def _start_error(self, what: str) -> ClusterStartError:
        tails = "\n".join(
            f"--- node {n.address} ({n.log}):\n{log_tail(n.log)}" for n in self._nodes
        )
        return ClusterStartError(f"loopback Ray cluster: {what}\n{tails}")

    # --- nodes that join and nodes lost -------------------------------------------------------

    def add_node(self) -> str:
        """Start the next spare node and wait until it is alive in the cluster; its address.
        A node that does not come up in ``start_timeout_s`` is killed again
        (:class:`ClusterStartError`)."""
        if not self._nodes:
            raise RuntimeError("the cluster is not started")
        left = self.spare_addresses
        if not left:
            raise RuntimeError(f"no spare node left (the cluster has spare={self.spare})")
        node = next(n for n in self._nodes if n.address == left[0])
        self._launch(node)
        self._up.append(node.index)
        if node.sid is not None and self._port_start is not None:
            hold_ports(self._port_start, [node.sid])
            tell_watchdog(self._watchdog, node.sid)
        try:
            self.wait_alive(self.start_timeout_s)
        except BaseException:
            self.kill_node(node.address)
            raise
        return node.address

    def kill_node(self, address: str) -> list[int]:
        """End the worker node at ``address`` as a machine lost: SIGKILL to every process of
        its session at once, no grace (the cluster sees it dead at its next health checks).
        The pids killed, also kept in ``stopped_pids``."""
        up = {self._nodes[i].address: self._nodes[i] for i in self._up} if self._nodes else {}
        node = up.get(address)
        if node is None or node.sid is None:
            raise ValueError(f"address: no node up at {address!r}; the nodes up: {sorted(up)}")
        if node.index == 0:
            raise ValueError(f"address: {address} is the head; kill_node ends a worker node")
        killed = kill_sessions([node.sid])
        self.stopped_pids += [p for p in killed if p not in self.stopped_pids]
        if node.process is not None:
            node.process.wait(timeout=10)
        self._up.remove(node.index)
        return killed

    # --- processes and stop -------------------------------------------------------------------

    @property
    def sessions(self) -> dict[str, int]:
        """Each node's session id (the pid of its ``ray start``), by address."""
        return {n.address: n.sid for n in self._nodes if n.sid is not None}

    def processes(self) -> dict[str, list[int]]:
        """Every running process of each node (by address): its session's members."""
        return {n.address: session_members(n.sid) for n in self._nodes if n.sid is not None}

    def stop(self) -> None:
        """Stop the worker nodes, then the head: SIGTERM to each node's process group, then
        SIGKILL to any process of its session still running after ``stop_grace_s``; then
        release the ports and remove the temporary folder. The pids it saw are kept in
        ``stopped_pids``. Raises RuntimeError if a process of the cluster survives."""
        try:
            self._terminate(self._nodes[1:])
            self._terminate(self._nodes[:1])
        finally:
            if self._watchdog is not None:  # it ends what is left, if anything
                if self._watchdog.stdin is not None:
                    self._watchdog.stdin.close()
                try:
                    self._watchdog.wait(timeout=2 * self.stop_grace_s + 30)
                except subprocess.TimeoutExpired:
                    pass
                self._watchdog = None
            if self._port_start is not None:
                release_ports(self._port_start)
                self._port_start = None
            if self._temp is not None:
                shutil.rmtree(self._temp, ignore_errors=True)
                self._temp = None
        left = [p for p in self.stopped_pids if is_running(p)]
        self._nodes = []
        self._up = list(range(self.size))
        if left:
            raise RuntimeError(f"processes of the loopback cluster still run after stop: {left}")

    def _terminate(self, nodes: Sequence[Node]) -> None:
        seen = end_sessions([n.sid for n in nodes if n.sid is not None], self.stop_grace_s)
        self.stopped_pids += [p for p in seen if p not in self.stopped_pids]
        for node in nodes:
            if node.process is not None:
                node.process.wait(timeout=10)

    # --- a driver in this process -------------------------------------------------------------

    @contextmanager
    def connect(self, **init_kwargs: Any) -> Iterator[ModuleType]:
        """This process as a driver of the cluster: ``ray`` after ``ray.init`` (with
        ``init_kwargs``), and ``ray.shutdown()`` on exit. Ray must not be initialised here."""
        import ray

        if ray.is_initialized():
            raise RuntimeError("ray is initialised in this process already: ray.shutdown() first")
        with environment(self._auth_env()):
            ray.init(address=self.address, _node_ip_address=self.head_address, **init_kwargs)
            try:
                yield ray
            finally:
                ray.shutdown()
