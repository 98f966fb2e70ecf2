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
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

from miles_ray.cluster_host import (
    NODE_PORTS,
    SOCKET_PATH_LIMIT,
    ClusterStartError,
    HostUnfitError,
    NodePorts,
    accepts,
    check_bindable,
    claim_ports,
    end_sessions,
    hold_ports,
    is_running,
    log_tail,
    release_ports,
    session_members,
)

__all__ = ["ClusterStartError", "HostUnfitError", "LoopbackCluster"]

#: the head is 127.0.0.2 (127.0.0.1 stays the address of the drivers and of everything else)
FIRST_HOST = 2
MAX_NODES = 16
_SOCKET_TAIL = len("/n15/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
_TEMP_NAME = len("/mlr") + 8
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass
class _Node:
    index: int
    address: str
    ports: NodePorts
    temp_dir: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        return self.temp_dir.with_suffix(".log")

    @property
    def sid(self) -> int | None:
        return None if self.process is None else self.process.pid


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_resources(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in value.items()
    )


def _per_node(name: str, value: Any, nodes: int, check: Any) -> list[Any]:
    """``value`` for each node: one value for all, or a sequence of one per node."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * nodes
    if len(values) != nodes:
        raise ValueError(f"{name}: {len(values)} values for {nodes} nodes (give one, or one each)")
    for v in values:
        if not check(v):
            raise ValueError(f"{name}: {v!r} is not allowed")
    return values


class LoopbackCluster:
    """A Ray cluster of ``nodes`` nodes on this machine: the head at 127.0.0.2, the others at
    127.0.0.3, 127.0.0.4, ...; a context manager that starts it and waits until every node is
    alive, and stops it (every process of it, none other) and removes its files on exit.

    ``cpus`` / ``gpus`` (logical, Ray's accounting) and ``resources`` (custom resources) are
    one value for every node or one per node; ``gpus`` defaults to 0, so that on a machine
    with GPUs the nodes do not each claim all of them. ``object_store_mb`` is each node's
    object store (Ray's minimum is 75).

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
    ) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes: {nodes} is not allowed (1 to {MAX_NODES})")
        if object_store_mb < 75:
            raise ValueError(f"object_store_mb: {object_store_mb} is not allowed (75 or more)")
        if start_timeout_s <= 0 or stop_grace_s <= 0:
            raise ValueError("start_timeout_s and stop_grace_s: a number of seconds above 0")
        root = temp_root or tempfile.gettempdir()
        if len(root) + _TEMP_NAME + _SOCKET_TAIL > SOCKET_PATH_LIMIT:
            raise ValueError(
                f"temp_root: {root!r} is too long for Ray's unix sockets (at most "
                f"{SOCKET_PATH_LIMIT - _TEMP_NAME - _SOCKET_TAIL} characters)"
            )
        self.cpus: list[int] = _per_node("cpus", cpus, nodes, _is_count)
        self.gpus: list[int] = _per_node("gpus", gpus, nodes, _is_count)
        each = resources if isinstance(resources, (list, tuple)) else [resources or {}] * nodes
        self.resources: list[dict[str, float]] = [
            dict(r) for r in _per_node("resources", each, nodes, _is_resources)
        ]
        self.size = nodes
        self.object_store_mb = object_store_mb
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.temp_root = root
        self._token = secrets.token_hex(32)
        self._nodes: list[_Node] = []
        self._port_start: int | None = None
        self._temp: Path | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.stopped_pids: list[int] = []

    # --- addresses ----------------------------------------------------------------------------

    @property
    def node_addresses(self) -> list[str]:
        """Every node's address, the head's first."""
        return [f"127.0.0.{FIRST_HOST + i}" for i in range(self.size)]

    @property
    def head_address(self) -> str:
        """The head node's address."""
        return self.node_addresses[0]

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
        return range(self._port_start, self._port_start + self.size * NODE_PORTS)

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
        for address in self.node_addresses:
            check_bindable(address)
        self._port_start = claim_ports(self.size * NODE_PORTS)
        self._temp = Path(tempfile.mkdtemp(prefix="mlr", dir=self.temp_root))
        self._nodes = [
            _Node(i, a, NodePorts(self._port_start + i * NODE_PORTS), self._temp / f"n{i}")
            for i, a in enumerate(self.node_addresses)
        ]
        try:
            for node in self._nodes:
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
        return env

    def _launch(self, node: _Node) -> None:
        head = node.index == 0
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        args += ["--node-ip-address", node.address, "--temp-dir", str(node.temp_dir)]
        args += ["--num-cpus", str(self.cpus[node.index]), "--num-gpus", str(self.gpus[node.index])]
        args += ["--object-store-memory", str(self.object_store_mb << 20), "--disable-usage-stats"]
        if self.resources[node.index]:
            args += ["--resources", json.dumps(self.resources[node.index])]
        args += node.ports.flags(head)
        args += ["--head", "--include-dashboard", "false"] if head else ["--address", self.address]
        node.temp_dir.mkdir()
        with open(node.log, "wb") as log:
            node.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._node_env(),
                start_new_session=True,
            )

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
        left_s = f"{deadline - time.monotonic():.1f}"
        probe = subprocess.Popen(
            [sys.executable, "-m", "miles_ray.cluster", left_s, self.address, *self.node_addresses],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self._node_env(),
        )
        try:
            while probe.poll() is None:
                self._check_nodes_run()
                if time.monotonic() > deadline + 30:
                    raise self._start_error("the probe of the nodes did not answer")
                time.sleep(0.2)
        finally:
            if probe.poll() is None:
                probe.kill()
            out = probe.communicate()[0].decode(errors="replace")
        last = out.strip().splitlines()[-1:] or [""]
        if probe.returncode != 0:
            raise self._start_error(
                f"not every node was alive within {timeout_s:.0f} s: {last[0]}\n{out[-2000:]}"
            )
        return list(json.loads(last[0])["alive"])

    def _check_nodes_run(self) -> None:
        for node in self._nodes:
            if node.process is not None and node.process.poll() is not None:
                raise self._start_error(
                    f"node {node.address} exited with {node.process.returncode}"
                )

    def _start_error(self, what: str) -> ClusterStartError:
        tails = "\n".join(
            f"--- node {n.address} ({n.log}):\n{log_tail(n.log)}" for n in self._nodes
        )
        return ClusterStartError(f"loopback Ray cluster: {what}\n{tails}")

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
        if left:
            raise RuntimeError(f"processes of the loopback cluster still run after stop: {left}")

    def _terminate(self, nodes: Sequence[_Node]) -> None:
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
        with _environment(self._auth_env()):
            ray.init(address=self.address, _node_ip_address=self.head_address, **init_kwargs)
            try:
                yield ray
            finally:
                ray.shutdown()


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment, and Ray's authentication read from it again;
    the previous values put back (and read again) on exit."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    _reload_ray_auth()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Make Ray read the authentication mode and token from the environment again (a process
    keeps what it read first, e.g. from an earlier local cluster)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _probe(timeout_s: float, address: str, head: str, expected: Sequence[str]) -> int:
    """Join the cluster at the ``head`` node (the first of ``expected``) and wait until exactly
    the ``expected`` node addresses are alive; print ``{"alive": [...]}`` last; 0 when they
    are."""
    import ray

    deadline = time.monotonic() + timeout_s
    alive: list[str] = []
    try:
        ray.init(
            address=address,
            _node_ip_address=head,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        while sorted(alive) != sorted(expected) and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
            alive = sorted(n["NodeManagerAddress"] for n in nodes if n["Alive"])
    finally:
        print(json.dumps({"alive": alive}), flush=True)
    return 0 if sorted(alive) == sorted(expected) else 1


if __name__ == "__main__":
    raise SystemExit(_probe(float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[3:]))
