"""Where the fleet's generation requests go: its engines, the routes over them, and the request
wrappers (the run's adapter named in every generation, the routing record asked for). Each
wrapper defines every method its callers use; nothing is forwarded by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles_core.contracts import AdapterSync, EngineClient, EngineLauncher
from miles_core.data import parse_version


@dataclass(eq=False)
class Engine:
    """One engine server as the fleet knows it."""

    index: int
    url: str
    client: EngineClient
    #: the weight version it serves (as the fleet published it)
    version: int = 0
    #: it stopped answering: no request goes to it until it is back with the current weights
    down: bool = False
    #: its new server is up and waits for the weights (only then does it serve)
    restarted: bool = False
    #: times it was restarted; a group started before a restart knows it lost its engine
    restarts: int = 0
    #: it left the job for good (drained, or lost with its node)
    left: bool = False


@dataclass(eq=False)
class Route:
    """Where generation requests go: one engine's client, or the router's over several."""

    client: EngineClient
    engines: list[Engine] = field(default_factory=list)

    @property
    def down(self) -> bool:
        """No engine behind it serves."""
        return all(e.down for e in self.engines)

    @property
    def version(self) -> int:
        """The oldest version any serving engine behind it has."""
        serving = [e.version for e in self.engines if not e.down]
        return min(serving) if serving else max((e.version for e in self.engines), default=0)


class Generator(Protocol):
    """What a rollout function generates with: ``generate`` and where it goes."""

    @property
    def base_url(self) -> str: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any: ...


class RouteEngine:
    """A route as a rollout function sees it: ``generate`` only, with every result stamped
    with a numeric weight version (the engine's own, or the route's when the engine reports
    none it can use)."""

    def __init__(self, route: Route) -> None:
        self.route = route

    @property
    def base_url(self) -> str:
        """Where the requests go (an engine, or the router)."""
        return self.route.client.base_url

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One generation through the route's client."""
        result = await self.route.client.generate(input_ids, sampling_params, **kwargs)
        result.weight_version = str(parse_version(result.weight_version, self.route.version))
        return result


class RequestWrapper:
    """A generator over ``engine`` that adds to the keyword arguments of each generation
    (:meth:`arguments`); the explicit base of the fleet's request wrappers."""

    def __init__(self, engine: Generator | EngineClient) -> None:
        self.engine = engine

    @property
    def base_url(self) -> str:
        """Where the requests go."""
        return self.engine.base_url

    def arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments a generation is sent with."""
        return kwargs

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One generation through ``engine``, with :meth:`arguments`."""
        return await self.engine.generate(input_ids, sampling_params, **self.arguments(kwargs))


class AdapterRequests(RequestWrapper):
    """A generator whose generations name an adapter (SGLang's ``lora_path``): a run that
    trains several wraps the engine a group generates with in the group's adapter."""

    def __init__(self, engine: Generator | EngineClient, name: str) -> None:
        super().__init__(engine)
        self.lora_path = name

    def arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The adapter (unless the caller names another)."""
        kwargs.setdefault("lora_path", self.lora_path)
        return kwargs


class AdapterClient(AdapterRequests):
    """An engine client whose generations name the run's one adapter: with an ``adapter`` the
    fleet's weights are the adapter's, the transport publishes it alone (the engines keep the
    base from ``model_path``) and the policy is the adapter. Its control calls are the
    client's."""

    def __init__(self, client: EngineClient, name: str) -> None:
        super().__init__(client, name)
        self.client = client

    async def input_logprobs(self, input_ids: Sequence[int], *, start: int) -> list[float]:
        """The client's prompt log-probs."""
        return await self.client.input_logprobs(input_ids, start=start)

    async def health(self) -> bool:
        """The client's ``/health``."""
        return await self.client.health()

    async def pause_generation(self, mode: str = "abort") -> Any:
        """The client's ``/pause_generation``."""
        return await self.client.pause_generation(mode)

    async def continue_generation(self) -> Any:
        """The client's ``/continue_generation``."""
        return await self.client.continue_generation()

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """The client's ``/release_memory_occupation``."""
        return await self.client.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """The client's ``/resume_memory_occupation``."""
        return await self.client.resume_memory_occupation(tags)

    async def get_weight_version(self) -> str | None:
        """The client's served weight version."""
        return await self.client.get_weight_version()

    async def get_server_info(self) -> dict[str, Any]:
        """The client's ``/server_info``."""
        return await self.client.get_server_info()

    async def close(self) -> None:
        """Close the client's connections."""
        await self.client.close()


class RoutedRequests(RequestWrapper):
    """A generator whose generations ask for the routed experts (SGLang's
    ``return_routed_experts``): a run with ``rollout.routing`` wraps the engine every rollout
    function (and through it the session server) generates with, so each result carries the
    routing record of its sequence."""

    def arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Ask for the routing record."""
        kwargs["return_routed_experts"] = True
        return kwargs


def client_for(launcher: EngineLauncher, adapter: AdapterSync | None, url: str) -> EngineClient:
    """The launcher's client of the server (or router) at ``url``, its generations naming
    ``adapter`` when there is one."""
    client = launcher.client(url)
    if adapter is None:
        return client
    # Its base_url is read-only (the client's): nothing sets it on a client.
    return AdapterClient(client, adapter.name)  # type: ignore[return-value]
