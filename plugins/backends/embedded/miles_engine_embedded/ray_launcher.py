"""Starts embedded engine servers from Ray actors (``launch_in: ray_actor``).

Each engine gets an actor with the CPUs/GPUs it reserves; the actor runs the same
:class:`~miles_engine_embedded.launcher.EmbeddedLauncher` on the node where Ray placed it, so it
owns the server process there, and reports the server's URL once ``/health`` answers. Killing
the actor (``stop``/``shutdown``) stops its server first. Ray is imported only here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from miles_engine_embedded.launcher import EmbeddedLauncher, EngineStartError
from miles_engine_embedded.plugin import EmbeddedEngineConfig

if TYPE_CHECKING:
    from miles_engine_client import EngineClient


class EngineHost:
    """The actor's body: one embedded launcher on the actor's node."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.launcher = EmbeddedLauncher(EmbeddedEngineConfig.model_validate(options))

    def launch(self, model_path: str, index: int) -> str:
        """Start the server; its URL once healthy."""
        return self.launcher.launch(model_path, index=index)

    def pids(self, index: int) -> tuple[int, int]:
        """(the actor's pid, the server's pid)."""
        return os.getpid(), self.launcher.processes[index].pid

    def stop(self, index: int) -> None:
        """Stop the server."""
        self.launcher.stop(index)


class RayEmbeddedLauncher:
    """:class:`miles_core.contracts.EngineLauncher` whose servers live in Ray actors. Joins the
    Ray cluster named by ``RAY_ADDRESS`` (or starts a local one) on first use."""

    def __init__(self, options: EmbeddedEngineConfig) -> None:
        self.options = options.model_copy(update={"launch_in": "process"})
        self.actors: dict[int, Any] = {}
        self.urls: dict[int, str] = {}

    def _ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False
            )
        return ray

    def launch(self, model_path: str, *, index: int) -> str:
        """Create engine ``index``'s actor and start its server; returns the URL."""
        ray = self._ray()
        if index in self.actors:
            raise EngineStartError(f"engine {index} is already running at {self.urls[index]}")
        actor_cls = ray.remote(
            num_cpus=self.options.ray_num_cpus, num_gpus=self.options.ray_num_gpus
        )(EngineHost)
        actor = actor_cls.remote(self.options.model_dump(mode="json"))
        self.actors[index] = actor
        try:
            url = ray.get(
                actor.launch.remote(model_path, index), timeout=self.options.startup_timeout_s + 60
            )
        except Exception as exc:
            self.stop(index)
            raise EngineStartError(
                f"engine {index} failed to start in its Ray actor: {exc}"
            ) from exc
        self.urls[index] = str(url)
        return str(url)

    def pids(self, index: int) -> tuple[int, int]:
        """(the actor's pid, the server's pid) of engine ``index``."""
        return tuple(self._ray().get(self.actors[index].pids.remote(index)))  # type: ignore[return-value]

    def client(self, url: str, *, timeout_s: float | None = None) -> EngineClient:
        """A ``miles_engine_client.EngineClient`` for the server at ``url``."""
        from miles_engine_client import EngineClient

        return EngineClient(url, timeout_s=timeout_s)

    def stop(self, index: int) -> None:
        """Stop engine ``index``'s server, then its actor."""
        actor = self.actors.pop(index, None)
        self.urls.pop(index, None)
        if actor is None:
            return
        ray = self._ray()
        try:
            ray.get(actor.stop.remote(index), timeout=30)
        finally:
            ray.kill(actor)

    def shutdown(self) -> None:
        """Stop every engine this launcher started."""
        for index in list(self.actors):
            self.stop(index)
