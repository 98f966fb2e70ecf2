"""A trainer's ranks wherever they run: what the controller asks of them (:class:`Ranks`), what
a placement provides to start them elsewhere (:class:`RankLauncher`), and what runs in a rank's
process whoever started it (:func:`build_rank`, :func:`collective_export`,
:class:`RankServer`).

Two kinds of :class:`Ranks` exist: :class:`miles_trainer_common.processes.ProcessWorkers`
(local processes, the default) and a placement's (the Ray placement: one actor per rank, each
in its own bundle, possibly on another node). Both build each rank as
``Class(options, rank, world_size, rendezvous, **worker_kwargs)``: ``rendezvous`` is the path
of a ``FileStore`` (ranks on one machine) or ``tcp://address:port``, a ``TCPStore`` hosted by
rank 0 at its node's address (ranks on several).
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

Pairs = Iterator[tuple[str, Tensor]]


def resolve(path: str) -> Any:
    """The object a ``"module:attr"`` path names."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{path!r} is not a 'module:attr' path")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def class_path(cls: type) -> str:
    """The ``"module:Class"`` path of ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class RankSpec:
    """What every rank is built from: ``worker`` (``"module:Class"`` of the rank),
    ``options_cls`` (``"module:Class"`` of its options model), ``options`` (as JSON data,
    validated again in the rank's process), ``name`` (the backend's, in messages) and
    ``worker_kwargs`` (more keyword arguments of the rank class, pickled to its process)."""

    worker: str
    options_cls: str
    options: dict[str, Any]
    name: str
    world_size: int
    timeout_s: float
    worker_kwargs: dict[str, Any] = field(default_factory=dict)


def rank_spec(
    options: Any,
    *,
    worker: str,
    name: str,
    options_cls: str | None = None,
    worker_kwargs: dict[str, Any] | None = None,
) -> RankSpec:
    """The spec of a backend's ranks from its options (a pydantic model with ``world_size``,
    the number of ranks, and ``timeout_s``, how long a silent rank may take to answer);
    ``options_cls``: by default the options' own type."""
    return RankSpec(
        worker=worker,
        options_cls=options_cls or class_path(type(options)),
        options=options.model_dump(mode="json"),
        name=name,
        world_size=int(options.world_size),
        timeout_s=float(options.timeout_s),
        worker_kwargs=dict(worker_kwargs or {}),
    )


class Ranks(Protocol):
    """A trainer's running ranks, as the controller drives them. Every call reaches every
    rank; the first rank's error or death stops them all and is raised with its traceback."""

    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; the answers in rank order."""
        ...

    def export(self, method: str = "export_tensors", **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """The whole tensors of the ranks' collective ``method(device="cpu", **kwargs)``, from
        rank 0, one at a time."""
        ...

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks (idempotent)."""
        ...


class RankLauncher(Protocol):
    """Starts a trainer's ranks somewhere other than this machine's processes (a placement's):
    a trainer controller given one runs every world size through it."""

    def __call__(self, spec: RankSpec, server: type[RankServer]) -> Ranks:
        """Start ``spec.world_size`` processes, each holding a ``server`` (the body of a rank
        someone else placed), and return them once each rank has joined the group."""
        ...

    def close(self) -> None:
        """Release what the launcher holds (called by the trainer's ``close``, after the
        ranks')."""
        ...


def build_rank(spec: RankSpec, rank: int, rendezvous: str) -> Any:
    """Rank ``rank`` of ``spec``, joined to its group at ``rendezvous``."""
    model = resolve(spec.options_cls)
    options = model.model_validate(spec.options)
    return resolve(spec.worker)(options, rank, spec.world_size, rendezvous, **spec.worker_kwargs)


# --- the collective export ------------------------------------------------------------------

#: the dtypes a relayed tensor may have (its index travels in the header)
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


def _relay(pair: tuple[str, Tensor] | None, rank: int) -> tuple[str, Tensor]:
    """Rank 0's (name, tensor) on every rank: a header (name length, dtype, shape), the name's
    bytes and the tensor, each broadcast from rank 0 (plain tensors: nothing is unpickled)."""
    import torch.distributed as dist

    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    if rank == 0:
        assert pair is not None
        name, tensor = pair
        encoded = torch.tensor(list(name.encode()), dtype=torch.uint8)
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"tensor {name!r} ({tensor.dtype}, {tensor.dim()} dims) cannot be relayed to "
                f"another rank: dtypes {[str(d) for d in _DTYPES]}, at most {_MAX_DIMS} dims"
            )
        header[0], header[1], header[2] = len(encoded), _DTYPES.index(tensor.dtype), tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.broadcast(header, src=0)
    length, code, ndim = (int(v) for v in header[:3])
    if rank != 0:
        encoded = torch.empty(length, dtype=torch.uint8)
        shape = [int(v) for v in header[3 : 3 + ndim]]
        tensor = torch.empty(shape, dtype=_DTYPES[code])
    dist.broadcast(encoded, src=0)
    data = tensor.contiguous() if rank == 0 else tensor
    dist.broadcast(data, src=0)
    return bytes(encoded.tolist()).decode(), data


def collective_export(
    worker: Any,
    method: str,
    kwargs: dict[str, Any] | None = None,
    receivers: frozenset[int] = frozenset({0}),
    *,
    into_kept: bool = False,
) -> Generator[tuple[str, Tensor], None, None]:
    """Run on every rank at once: the whole tensors of the rank's collective
    ``method(device="cpu", **kwargs)``, yielded on the ``receivers`` (rank 0's tensors,
    relayed to the other receivers through the group), one at a time. After each tensor rank
    0 tells every rank whether to go on: closing the iterator on rank 0 stops every rank. A
    receiver other than 0 that wants no more tensors must go on iterating (it takes part in
    every relay) until the iterator ends. ``into_kept``: the consumer is done with each
    tensor before the next export (it copies it), so the export may write into the memory of
    the last one (:attr:`~.worker.TrainerRank.export_into_kept`)."""
    import torch.distributed as dist

    rank, world = worker.rank, worker.world_size
    relay = bool(receivers - {0})
    produced = getattr(worker, method)(device="cpu", **(kwargs or {}))
    worker.export_into_kept = into_kept
    try:
        for name, tensor in produced:
            pair = _relay((name, tensor) if rank == 0 else None, rank) if relay else (name, tensor)
            go = torch.ones(1, dtype=torch.int64)
            if rank in receivers:
                try:
                    yield pair
                except GeneratorExit:
                    if rank == 0 and world > 1:
                        dist.broadcast(torch.zeros(1, dtype=torch.int64).to(worker.device), 0)
                    raise
            if world > 1:
                flag = go.to(worker.device)
                dist.broadcast(flag, src=0)
                if not int(flag[0]):
                    break
    finally:
        produced.close()
        worker.export_into_kept = False


# --- a rank in a process someone else placed ----------------------------------------------


def free_address() -> tuple[str, int]:
    """This node's address (``miles_core.hosts.node_address``) and a port free on it now."""
    from miles_core.hosts import node_address

    host = node_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])


class RankServer:
    """The body of one rank's process when a placement started it (a Ray actor): made bare,
    then :meth:`start`-ed once rank 0's rendezvous address is known; serves the controller's
    calls and exports, and, on ranks whose node holds engines, the weight sender that feeds
    them.

    ``env``: variables set in this process first (the node's address, the run's API key).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        self.worker: Any = None
        self.rank = -1
        self.sender: Any = None

    def rendezvous(self) -> str:
        """``tcp://address:port`` at this node's address, a port free now (rank 0's)."""
        host, port = free_address()
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def start(self, spec: RankSpec, rank: int, rendezvous: str) -> None:
        """Build rank ``rank`` of ``spec`` and join its group at ``rendezvous``."""
        self.worker = build_rank(spec, rank, rendezvous)
        self.rank = rank

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``method(*args, **kwargs)`` of the rank (a public one)."""
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is not a rank's public method")
        return getattr(self.worker, method)(*args, **kwargs)

    def export(self, method: str, kwargs: dict[str, Any]) -> Pairs:
        """The collective export, yielded here on rank 0 (a streaming call: Ray copies each
        tensor into its object store)."""
        yield from collective_export(self.worker, method, kwargs, into_kept=True)

    def follow(self, method: str, kwargs: dict[str, Any]) -> None:
        """Take part in the collective export of a rank that yields nothing here."""
        for _ in collective_export(self.worker, method, kwargs, into_kept=True):
            pass

    def attach_sender(self, make: Callable[[], Any]) -> None:
        """Build this rank's weight sender with ``make()`` (idempotent)."""
        if self.sender is None:
            self.sender = make()

    def send(
        self,
        method: str,
        kwargs: dict[str, Any],
        engines: list[str],
        receivers: list[int],
        version: int,
        adapter: Any = None,
    ) -> dict[str, float]:
        """Collective: export ``method`` and, on a rank with ``engines``, send the weights to
        them through this rank's sender (``receivers``: every rank that has engines)."""
        # the sender is done with each tensor when it returns
        stream = collective_export(
            self.worker, method, kwargs, frozenset(receivers), into_kept=True
        )
        try:
            if not engines:
                return {}
            return self.send_tensors(stream, engines, version, adapter)
        finally:
            if self.rank == 0:
                stream.close()  # tells every rank to stop, if the sender stopped early
            else:
                for _ in stream:  # every relay and flag of rank 0, to the end
                    pass

    def send_tensors(
        self, weights: Iterable[tuple[str, Tensor]], engines: list[str], version: int, adapter: Any
    ) -> dict[str, float]:
        """Send ``weights`` (this rank's export, or tensors that came from elsewhere) to
        ``engines`` through this rank's sender."""
        if self.sender is None:
            raise RuntimeError(f"rank {self.rank} has engines to feed but no sender")
        extra = {} if adapter is None else {"adapter": adapter}
        metrics: dict[str, float] = self.sender.send(
            weights, version=version, engines=engines, **extra
        )
        return metrics

    def where(self) -> dict[str, Any]:
        """This process: its pid, host name and node address."""
        from miles_core.hosts import node_address

        return {"pid": os.getpid(), "host": socket.gethostname(), "address": node_address()}

    def close(self) -> None:
        """Close the sender, then leave the group (idempotent)."""
        import torch.distributed as dist

        sender, self.sender = self.sender, None
        try:
            if sender is not None:
                sender.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
