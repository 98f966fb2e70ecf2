"""Starts embedded engine servers from Ray actors (``launch_in: ray_actor``).

Each engine gets an actor with the CPUs/GPUs it reserves; the actor runs the same
:class:`~miles_engine_embedded.launcher.EmbeddedLauncher` on the node where Ray placed it, so it
owns the server process there, and reports the server's URL once ``/health`` answers. Killing
the actor (``stop``/``shutdown``) stops its server first; an actor that dies otherwise (killed,
its placement group removed, its driver gone) takes its server with it through a small reaper
process. A placement (the ``miles-ray`` plugin) may choose each actor's resources and bundle
with :meth:`RayEmbeddedLauncher.place_engines`. Ray is imported only here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_core.hosts import forwarded_env
from miles_engine_embedded.launcher import EmbeddedLauncher, EngineStartError
from miles_engine_embedded.plugin import EmbeddedEngineConfig

if TYPE_CHECKING:
    from miles_engine_embedded.client import EmbeddedClient


# Watches the actor (argv[1]) and the server (argv[2], leader of its own process group): when
# the actor is gone but the server is not, the server's group gets SIGTERM, then SIGKILL.
_REAPER = """
import os, signal, sys, time
actor, server = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while alive(actor) and alive(server):
    time.sleep(0.5)
if alive(server):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(server, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while alive(server) and time.monotonic() < end:
            time.sleep(0.2)
"""


#: what an engine actor runs by default: the embedded engine's process launcher
EMBEDDED_HOST = "miles_engine_embedded.ray_launcher:embedded_launcher"


def embedded_launcher(options: dict[str, Any]) -> EmbeddedLauncher:
    """The embedded engine's process launcher from its options (as JSON)."""
    return EmbeddedLauncher(EmbeddedEngineConfig.model_validate(options))


class EngineHost:
    """The actor's body: one process launcher on the actor's node, made by the function that
    ``host`` names (``"module:attr"``, called with the options as JSON): the embedded engine's
    by default, or another engine's built on :class:`EmbeddedLauncher`."""

    def __init__(
        self, options: dict[str, Any], host: str = EMBEDDED_HOST, env: dict[str, str] | None = None
    ) -> None:
        import importlib

        import ray

        from miles_core.hosts import NODE_ADDRESS_ENV

        # The server binds and advertises this node's address (engine host unset); the run's
        # API key, when the driver has one, reaches the server through this environment.
        os.environ.update(env or {})
        os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()
        module, _, attr = host.partition(":")
        self.launcher = getattr(importlib.import_module(module), attr)(options)
        # The server is this actor's child, not a fork server's: Ray stops it with the actor.
        self.launcher.fork = False

    def launch(self, model_path: str, index: int) -> str:
        """Start the server; its URL once healthy. A reaper, started as soon as the server is
        spawned, stops the server if this actor dies without :meth:`stop` (during the start
        too)."""
        self.launcher.on_spawn = self._reap
        return str(self.launcher.launch(model_path, index=index))

    @staticmethod
    def _reap(server: int) -> None:
        """Start the reaper of the server ``server`` (a pid) and this actor's process."""
        if not sys.platform.startswith("linux"):  # the reaper reads /proc
            return
        subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(os.getpid()), str(server)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives this actor's process
        )

    def pids(self, index: int) -> tuple[int, int]:
        """(the actor's pid, the server's pid)."""
        return os.getpid(), self.launcher.processes[index].pid

    def where(self) -> dict[str, Any]:
        """The actor's pid, node address and placement group (None outside one)."""
        import ray

        from miles_core.hosts import node_address

        return {
            "pid": os.getpid(),
            "address": node_address(),
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
        }

    def stop(self, index: int) -> None:
        """Stop the server."""
        self.launcher.stop(index)


def _needs(options: dict[str, Any]) -> str:
    """What an actor with the ``ray.remote`` ``options`` reserves, in words."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    wanted = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0}
    wanted.update(options.get("resources") or {})
    text = "{" + ", ".join(f"{k}: {float(v):g}" for k, v in wanted.items()) + "}"
    strategy = options.get("scheduling_strategy")
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        bundle = strategy.placement_group_bundle_index
        text += f" in bundle {bundle} of its placement group (that bundle's node gone or full)"
    return text


class RayEmbeddedLauncher:
    """:class:`miles_core.contracts.EngineLauncher` whose servers live in Ray actors. Joins the
    Ray cluster named by ``RAY_ADDRESS`` (or starts a local one) on first use."""

    #: the function the engine actors make their process launcher with (see
    #: :class:`EngineHost`); an engine built on :class:`EmbeddedLauncher` names its own
    host: str = EMBEDDED_HOST

    def __init__(self, options: Any) -> None:
        self.options = options.model_copy(update={"launch_in": "process"})
        self.num_engines = options.num_engines
        self.actors: dict[int, Any] = {}
        self.urls: dict[int, str] = {}
        self._placement: Callable[[int], dict[str, Any]] | None = None
        #: how long an engine's actor may wait for a node with room before its start fails
        #: (an actor Ray cannot place waits forever: its node gone, no other with room)
        self.placement_timeout_s = 60.0

    def engine_resources(self) -> dict[str, float]:
        """What each engine's actor reserves (``ray_num_cpus``, ``ray_num_gpus``), for a
        placement to size the engines' bundles."""
        return {"CPU": self.options.ray_num_cpus, "GPU": self.options.ray_num_gpus}

    def place_engines(
        self,
        actor_options: Callable[[int], dict[str, Any]],
        placement_timeout_s: float | None = None,
    ) -> None:
        """Let a placement choose engine ``i``'s actor options: ``actor_options(i)`` (its
        resources and scheduling strategy, e.g. a placement-group bundle) replaces the
        launcher's own ``ray_num_cpus`` / ``ray_num_gpus``; ``placement_timeout_s``, when
        given, bounds the wait for an actor's node."""
        if placement_timeout_s is not None:
            if placement_timeout_s <= 0:
                raise ValueError(
                    f"placement_timeout_s: {placement_timeout_s!r} is not allowed (above 0)"
                )
            self.placement_timeout_s = float(placement_timeout_s)
        self._placement = actor_options

    def _ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            # a cluster started here for this process alone listens on loopback only (Ray
            # turns 127.0.0.1 into the machine's routable address; another loopback it keeps)
            local = {} if address else {"_node_ip_address": "127.0.0.1"}
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
        return ray

    def launch(self, model_path: str, *, index: int) -> str:
        """Create engine ``index``'s actor, wait (``placement_timeout_s`` at most) until Ray
        has placed it on a node, and start its server; returns the URL."""
        ray = self._ray()
        if index in self.actors:
            raise EngineStartError(f"engine {index} is already running at {self.urls[index]}")
        actor_options: dict[str, Any] = {
            "num_cpus": self.options.ray_num_cpus,
            "num_gpus": self.options.ray_num_gpus,
        }
        if self._placement is not None:
            try:
                actor_options = self._placement(index)
            except Exception as exc:
                raise EngineStartError(f"engine {index} cannot be placed: {exc}") from exc
        actor = (
            ray.remote(EngineHost)
            .options(**actor_options)
            .remote(self.options.model_dump(mode="json"), self.host, forwarded_env())
        )
        self.actors[index] = actor
        try:
            self._wait_placed(ray, index, actor, actor_options)
            url = ray.get(
                actor.launch.remote(model_path, index), timeout=self.options.startup_timeout_s + 60
            )
        except EngineStartError:
            self.stop(index)
            raise
        except Exception as exc:
            self.stop(index)
            raise EngineStartError(
                f"engine {index} failed to start in its Ray actor: {exc}"
            ) from exc
        self.urls[index] = str(url)
        return str(url)

    def _wait_placed(self, ray: Any, index: int, actor: Any, options: dict[str, Any]) -> None:
        """Wait until ``actor`` runs on a node (its ``where`` answers). An actor Ray cannot
        place waits forever; one still unplaced after ``placement_timeout_s`` is an
        :class:`EngineStartError` naming what it needs, and the actor is killed."""
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(actor.where.remote(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            # nothing runs in it yet: killed at once, not asked to stop a server first
            self.actors.pop(index, None)
            ray.kill(actor)
            raise EngineStartError(
                f"engine {index}'s Ray actor was not placed within "
                f"{self.placement_timeout_s:g} s: no alive node could take {_needs(options)}; "
                "add a node with room, or free some"
            ) from None

    def pids(self, index: int) -> tuple[int, int]:
        """(the actor's pid, the server's pid) of engine ``index``."""
        return tuple(self._ray().get(self.actors[index].pids.remote(index)))  # type: ignore[return-value]

    def where(self, index: int) -> dict[str, Any]:
        """Engine ``index``'s actor: its pid and placement group."""
        return dict(self._ray().get(self.actors[index].where.remote()))

    def client(self, url: str, *, timeout_s: float | None = None) -> EmbeddedClient:
        """An :class:`~miles_engine_embedded.client.EmbeddedClient` for the server at ``url``
        (SGLang's client and the embedded engine's extensions)."""
        from miles_engine_embedded.client import EmbeddedClient

        return EmbeddedClient(url, timeout_s=timeout_s)

    def stop(self, index: int) -> None:
        """Stop engine ``index``'s server, then its actor. An actor already dead (or stuck) is
        killed as it is: its reaper stops the server."""
        actor = self.actors.pop(index, None)
        self.urls.pop(index, None)
        if actor is None:
            return
        ray = self._ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(actor.stop.remote(index), timeout=30)
        except (RayActorError, GetTimeoutError):
            pass
        finally:
            ray.kill(actor)

    def shutdown(self) -> None:
        """Stop every engine this launcher started (all of them, even if one fails; the first
        failure is raised at the end)."""
        errors: list[BaseException] = []
        for index in list(self.actors):
            try:
                self.stop(index)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
