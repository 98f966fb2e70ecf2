"""What the loop asks of engines and of what moves weights to them: the engine client and
launcher, weight transports and receivers, the router, and the schedule that interleaves
rollout and training. Tensor types are named as strings: this module imports no torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.data import Group, RoutedExperts

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor
else:
    Tensor = Any


class Generation(Protocol):
    """What an engine client's ``generate`` returns: the generated tokens, their log-probs, why
    generation ended (stop / length / abort), the weight version the engine stamped (a
    string; may be empty) and the routing record of the sequence (``None`` unless the request
    asked for it with ``return_routed_experts``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str
    routed_experts: RoutedExperts | None


@runtime_checkable
class EngineClient(Protocol):
    """What the core needs of an engine client: a subset of SGLang's native HTTP API, the same
    against a real SGLang server and the embedded engine. The core calls nothing else."""

    #: the server's base URL (``http://host:port``); weight transports publish to it
    base_url: str

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> Generation:
        """``POST /generate``; see :class:`Generation`."""
        ...

    async def input_logprobs(self, input_ids: Sequence[int], *, start: int) -> list[float]:
        """The log-probs the served model gives the tokens at positions
        ``start..len(input_ids)-1``, each after the tokens before it (``start >= 1``), without
        generating: SGLang's prompt log-probs of ``POST /generate`` (``return_logprob``,
        ``logprob_start_len``, ``max_new_tokens`` 0). How a teacher scores a student's tokens.
        Raises when the engine returns fewer, or a null one."""
        ...

    async def health(self) -> bool:
        """``GET /health``: True when the server answers 200, False when it does not answer or
        answers an error status (a dead or hung engine). Anything else raises."""
        ...

    async def pause_generation(self, mode: str = "abort") -> Any:
        """``POST /pause_generation`` with SGLang's mode: ``abort`` (in-flight requests end with
        finish reason ``abort``), ``retract`` or ``in_place``."""
        ...

    async def continue_generation(self) -> Any:
        """``POST /continue_generation``."""
        ...

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /release_memory_occupation`` (``kv_cache``, ``weights``)."""
        ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /resume_memory_occupation``."""
        ...

    async def get_weight_version(self) -> str | None:
        """The weight version the server reports (``weight_version`` of ``GET /model_info`` in
        SGLang 0.5.23), as a string; ``None`` when it reports none."""
        ...

    async def get_server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (``max_running_requests`` among others)."""
        ...

    async def close(self) -> None:
        """Close the client's connections (the server keeps running)."""
        ...


@runtime_checkable
class PeerWeightsClient(Protocol):
    """The client of an engine whose record declares the ``weights_from_peer`` capability
    (Miles's extension, not SGLang's): the core asks an engine that joins a running job to copy
    the weights another engine serves, instead of waiting for the next weight update."""

    async def pull_weights(self, source: str, *, timeout_s: float) -> dict[str, Any]:
        """Copy the weights the engine at ``source`` serves (``POST /miles/pull_weights``)
        and serve them under its weight version; answers ``weight_version``, ``bytes`` and
        ``seconds``. Raises when the copy is refused (the served weights then unchanged)."""
        ...


@runtime_checkable
class EngineLauncher(Protocol):
    """Starts and stops engine servers; each server speaks the SGLang-native HTTP API."""

    #: engine servers a run launches (indices ``0 .. num_engines - 1``)
    num_engines: int

    def launch(self, model_path: str, *, index: int) -> str:
        """Start server ``index`` and return its base URL once its health endpoint answers."""
        ...

    def client(self, url: str) -> EngineClient:
        """A client for the server at ``url``."""
        ...

    def stop(self, index: int) -> None:
        """Stop whatever is left of server ``index`` (a dead or hung process, its port);
        a no-op when nothing of it runs."""
        ...

    def shutdown(self) -> None:
        """Stop every server this launcher started."""
        ...


@dataclass(frozen=True)
class AdapterSync:
    """What a transport publishes instead of the model when the run trains an adapter: the
    engines keep their base weights and serve the adapter under ``name`` (the ``lora_path`` of
    generation requests), built from ``config`` (PEFT's ``adapter_config.json`` fields) and the
    adapter's tensors (PEFT names, ``...lora_A.weight`` / ``...lora_B.weight``)."""

    name: str
    config: Mapping[str, Any]


@runtime_checkable
class WeightTransport(Protocol):
    """The trainer side of a weight transport: publishes the trainer's weights to the engines
    through their HTTP API (SGLang's weight-update endpoints, or an engine capability the
    transport's record declares it needs)."""

    def send(
        self,
        weights: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` in bounded buckets to every engine at the base URLs ``engines``
        and have each commit ``version``; returns timing metrics. The set of engines may
        differ from the previous call's (an engine restarted): the transport re-forms what it
        keeps per engine. Raises on timeout or a rejected bucket, leaving the engines on their
        previous version. Pausing and resuming generation around it is the caller's job.

        With ``adapter``, ``weights`` are an adapter's tensors only: each engine replaces the
        adapter ``adapter.name`` with them (loading it if it has none) and keeps its base
        weights. Only a transport whose record declares ``adapter_capabilities`` is given
        one: a run with an adapter and any other transport is refused at start."""
        ...

    def close(self) -> None:
        """Release what the sender holds (groups, buffers, sockets); idempotent."""
        ...


@runtime_checkable
class Router(Protocol):
    """A request router in front of several engines (``sglang-router`` in production):
    generation goes through it, control calls go to each engine directly."""

    def start(self, engines: Sequence[str]) -> str:
        """Start routing over the engines at these base URLs; returns the router's base URL
        (an :class:`EngineClient` built for it generates through the router)."""
        ...

    def set_engines(self, engines: Sequence[str]) -> None:
        """Route over exactly these engines from now on (one left, or came back)."""
        ...

    def alive(self) -> bool:
        """Whether the router process still serves."""
        ...

    def stop(self) -> None:
        """Stop the router (idempotent)."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """The engine side of a weight transport, embedded in each engine."""

    version: int

    def receive(self, target: Any) -> int:
        """Receive one update into ``target`` (a callable taking a list of (name, tensor), or a
        mutable mapping of tensors); returns the committed version. Leaves ``target`` on its
        previous weights when a bucket is rejected or a wait times out."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Schedule(Protocol):
    """How rollout and training interleave; the run takes its batches from it. Its coroutines
    run on the run's I/O event loop, next to the engine fleet."""

    def attach(self, ctx: Any) -> None:
        """Take the run's parts (a :class:`miles_core.runtime.schedules.ScheduleContext`: the
        config, the engine fleet, the rollouts, the judge, the ledger); called once."""
        ...

    async def next_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The whole groups step ``step`` trains on, each already judged and kept, with the
        rollout's metrics (``time/rollout_s`` among them)."""
        ...

    async def publish(self, version: int) -> dict[str, float]:
        """Have the engines serve ``version`` (through the fleet), pausing generation as the
        schedule needs."""
        ...

    async def metrics(self, version: int) -> dict[str, float]:
        """The schedule's own per-step metrics."""
        ...

    async def stop(self) -> None:
        """Stop generating; what is in flight or queued is dropped as ``run_ended``. Raises
        the error of a group that failed after the last batch."""
        ...
