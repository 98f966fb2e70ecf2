"""The parts of a :class:`~miles_ray.cluster.LoopbackCluster` that stand alone: a node's record,
the per-node option check, the driver's authentication environment, and the probe that waits
(in a process of its own: ``python -m miles_ray.cluster_nodes``) until the expected nodes are
alive."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_ray.cluster_host import SOCKET_PATH_LIMIT, NodePorts

MAX_NODES = 16
_SOCKET_TAIL = len("/n15/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
_TEMP_NAME = len("/mlr") + 8


@dataclass
class Node:
    """One node of the cluster: its address, ports and files, and its ``ray start`` process
    (None while the node is a spare not yet started)."""

    index: int
    address: str
    ports: NodePorts
    temp_dir: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        """The node's ``ray start`` output."""
        return self.temp_dir.with_suffix(".log")

    @property
    def sid(self) -> int | None:
        """The node's session id (the pid of its ``ray start``); None before it starts."""
        return None if self.process is None else self.process.pid

    def start(self, args: list[str], env: dict[str, str]) -> None:
        """Run ``args`` (the node's ``ray start``) in a session of its own, its output in
        :attr:`log`."""
        self.temp_dir.mkdir()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )


def ray_start_args(
    node: Node,
    cpus: int,
    gpus: int,
    object_store_mb: int,
    resources: dict[str, float],
    head: str | None,
    log_monitor: bool = False,
) -> list[str]:
    """The ``ray start --block`` command of ``node``: the head's when ``head`` (the cluster's
    address) is None, else a node joining the head there; with Ray's log monitor when
    ``log_monitor``; never with the autoscaler's monitor (the nodes are started by hand)."""
    args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
    args += ["--node-ip-address", node.address, "--temp-dir", str(node.temp_dir)]
    args += ["--num-cpus", str(cpus), "--num-gpus", str(gpus)]
    args += ["--object-store-memory", str(object_store_mb << 20), "--disable-usage-stats"]
    if resources:
        args += ["--resources", json.dumps(resources)]
    args += node.ports.flags(head is None)
    args += ["--include-log-monitor", "true" if log_monitor else "false"]
    args += (
        ["--head", "--include-dashboard", "false", "--no-monitor"]
        if head is None
        else [
            "--address",
            head,
        ]
    )
    return args


def is_count(value: Any) -> bool:
    """Whether ``value`` is an int of 0 or more (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_resources(value: Any) -> bool:
    """Whether ``value`` maps resource names to numbers of 0 or more."""
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in value.items()
    )


def per_node(name: str, value: Any, nodes: int, check: Any) -> list[Any]:
    """``value`` for each node: one value for all, or a sequence of one per node."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * nodes
    if len(values) != nodes:
        raise ValueError(
            f"{name}: {len(values)} values for {nodes} nodes, spare ones included (give one, "
            "or one each)"
        )
    for v in values:
        if not check(v):
            raise ValueError(f"{name}: {v!r} is not allowed")
    return values


def check_sizes(
    nodes: int, spare: int, object_store_mb: int, start_s: float, stop_s: float, root: str
) -> None:
    """Refuse a cluster's sizes that cannot work, naming the option (ValueError)."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes: {nodes} is not allowed (1 to {MAX_NODES})")
    if not is_count(spare) or nodes + spare > MAX_NODES:
        raise ValueError(f"spare: {spare!r} is not allowed (0 to {MAX_NODES - nodes})")
    if object_store_mb < 75:
        raise ValueError(f"object_store_mb: {object_store_mb} is not allowed (75 or more)")
    if start_s <= 0 or stop_s <= 0:
        raise ValueError("start_timeout_s and stop_grace_s: a number of seconds above 0")
    if len(root) + _TEMP_NAME + _SOCKET_TAIL > SOCKET_PATH_LIMIT:
        raise ValueError(
            f"temp_root: {root!r} is too long for Ray's unix sockets (at most "
            f"{SOCKET_PATH_LIMIT - _TEMP_NAME - _SOCKET_TAIL} characters)"
        )


def node_resources(
    cpus: Any, gpus: Any, resources: Any, total: int
) -> tuple[list[int], list[int], list[dict[str, float]]]:
    """Each of the ``total`` nodes' CPUs, GPUs and custom resources (each given once for all
    or once per node), checked."""
    each = resources if isinstance(resources, (list, tuple)) else [resources or {}] * total
    return (
        per_node("cpus", cpus, total, is_count),
        per_node("gpus", gpus, total, is_count),
        [dict(r) for r in per_node("resources", each, total, is_resources)],
    )


def run_probe(
    address: str, expected: Sequence[str], deadline: float, env: dict[str, str], check: Any
) -> tuple[int, str]:
    """Run the probe (:func:`_probe`, in a process of its own) until ``deadline`` (a
    ``time.monotonic()``), calling ``check()`` meanwhile (it raises when a node exits); its
    exit code and output. TimeoutError when it has not answered 30 s after the deadline."""
    left_s = f"{deadline - time.monotonic():.1f}"
    probe = subprocess.Popen(
        [sys.executable, "-m", "miles_ray.cluster_nodes", left_s, address, *expected],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        while probe.poll() is None:
            check()
            if time.monotonic() > deadline + 30:
                raise TimeoutError("the probe of the nodes did not answer")
            time.sleep(0.2)
    finally:
        if probe.poll() is None:
            probe.kill()
        out = probe.communicate()[0].decode(errors="replace")
    return probe.returncode, out


def tell_watchdog(watchdog: subprocess.Popen[bytes] | None, sid: int) -> None:
    """Tell a cluster's watchdog (see :func:`miles_ray.cluster_host.watch`) of one more node's
    session, to end should the cluster's owner end without stopping it."""
    if watchdog is None or watchdog.stdin is None:
        return
    try:
        watchdog.stdin.write(f"{sid}\n".encode())
        watchdog.stdin.flush()
    except BrokenPipeError:
        pass  # the watchdog is gone: the owner's stop still ends the node


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
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
