"""World size N > 1: N spawned worker processes, one rank each, driven over pipes.

The controller sends every rank the same command and waits for all answers; any rank's error
or death stops all workers and is raised in the controller with the rank's traceback (the
other ranks may be blocked in a collective, so the group cannot be trusted afterwards).
Tensors cross the pipes through torch's shared-memory pickling.

Backend-blind: each child builds the backend's worker class (a ``"module:Class"`` path)
as ``Class(options, rank, world_size, store_path)``, where ``options`` is the backend's
pydantic options model validated again in the child and ``store_path`` the file of a
``torch.distributed.FileStore`` the ranks rendezvous on. A command ``(method, args,
kwargs)`` runs ``worker.method(*args, **kwargs)``; ``export`` streams
``worker.export_tensors(device="cpu", **kwargs)`` from rank 0, every rank taking part in each
gather, so the worker also needs a ``device``.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection as mpc
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from pydantic import BaseModel
from torch import Tensor


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


class WorkerError(RuntimeError):
    """A worker process failed; the trainer's processes have been stopped."""


def _export(
    worker: Any,
    conn: Any,
    rank: int,
    method: str = "export_tensors",
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Stream the full tensors of ``worker.method(device="cpu", **kwargs)`` to the controller
    from rank 0, one at a time: after each tensor rank 0 waits for the controller's ``next``
    or ``stop`` and tells the other ranks, which take part in every gather."""
    import torch.distributed as dist

    for name, tensor in getattr(worker, method)(device="cpu", **(kwargs or {})):
        go = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            conn.send(("tensor", (name, tensor)))
            go[0] = 1 if conn.recv() == "next" else 0
        go = go.to(worker.device)
        dist.broadcast(go, src=0)
        if not int(go[0]):
            break
    conn.send(("done", None))


def worker_main(
    worker_cls: str,
    options_cls: str,
    options: dict[str, Any],
    rank: int,
    world_size: int,
    store: str,
    conn: Any,
    worker_kwargs: dict[str, Any] | None = None,
) -> None:
    """Entry point of one worker process: build the rank (``worker_cls``, a ``"module:Class"``
    path, from ``options`` validated by ``options_cls``, and ``worker_kwargs`` as they were
    pickled), then serve commands until ``close``."""
    import torch.distributed as dist

    try:
        model = resolve(options_cls)
        worker = resolve(worker_cls)(
            model.model_validate(options), rank, world_size, store, **(worker_kwargs or {})
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args, *rest = conn.recv()
            kwargs: dict[str, Any] = rest[0] if rest else {}
        except EOFError:  # the controller is gone
            break
        except BaseException:  # e.g. an argument that cannot be unpickled here
            conn.send(("error", traceback.format_exc()))
            continue
        if method == "close":
            break
        try:
            if method == "export":
                _export(worker, conn, rank, *args)
                continue
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessWorkers:
    """The controller side: starts the ranks and runs commands on all of them.

    Args:
        options: the backend's options, a pydantic model with ``world_size`` (the number of
            processes) and ``timeout_s`` (how long a silent rank may take to answer).
        worker: ``"module:Class"`` of the rank class, built in each child as
            ``Class(options, rank, world_size, store_path)``.
        options_cls: ``"module:Class"`` of the options model the child validates
            ``options.model_dump(mode="json")`` with; by default ``type(options)``.
        name: the backend's name, in the process names (``miles-{name}-rank{r}``), the
            temporary folder's prefix and the error messages (``"{name} rank 1 died ..."``).
        worker_kwargs: more keyword arguments of the rank class (the adapters' objects),
            pickled to each child.
    """

    def __init__(
        self,
        options: BaseModel,
        *,
        worker: str,
        options_cls: str | None = None,
        name: str,
        worker_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.options = options
        self.name = name
        self.world_size: int = getattr(options, "world_size")  # noqa: B009
        self._dir = tempfile.mkdtemp(prefix=f"miles-{name}-")
        ctx = mp.get_context("spawn")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._exporting = False
        store = os.path.join(self._dir, "store")
        dumped = options.model_dump(mode="json")
        options_path = options_cls or class_path(type(options))
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    worker,
                    options_path,
                    dumped,
                    rank,
                    self.world_size,
                    store,
                    child,
                    worker_kwargs,
                ),
                name=f"miles-{name}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._gather("start")

    @property
    def timeout_s(self) -> float:
        """The options' ``timeout_s``: the longest a rank may stay silent in one command."""
        return float(getattr(self.options, "timeout_s"))  # noqa: B009

    @property
    def closed(self) -> bool:
        """True once the workers were stopped."""
        return not self._procs

    def _fail(self, message: str) -> WorkerError:
        self.close(graceful=False)
        return WorkerError(message)

    def _recv(self, rank: int, what: str, deadline: float) -> tuple[str, Any]:
        conn, proc = self._conns[rank], self._procs[rank]
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise self._fail(
                    f"{self.name} rank {rank} died (exit code {proc.exitcode}) in {what}"
                )
            if time.monotonic() > deadline:
                raise self._fail(f"{self.name} rank {rank} did not answer {what} in time")
        try:
            kind, payload = conn.recv()
        except EOFError:
            # The rank died: its end of the pipe closed, which reads as "ready" above.
            proc.join(timeout=5)
            raise self._fail(
                f"{self.name} rank {rank} died (exit code {proc.exitcode}) in {what}"
            ) from None
        if kind == "error":
            raise self._fail(f"{self.name} rank {rank} failed in {what}:\n{payload}")
        return kind, payload

    def _gather(self, what: str) -> list[Any]:
        """Answers of every rank; the first error or death among them is raised at once."""
        if self.closed:
            raise WorkerError(f"the {self.name} worker processes were stopped")
        deadline = time.monotonic() + self.timeout_s
        answers: dict[int, Any] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = mpc.wait(list(pending.values()), timeout=0.2)
            for rank, conn in list(pending.items()):
                if conn in ready:
                    answers[rank] = self._recv(rank, what, deadline)[1]
                    del pending[rank]
                elif not (proc := self._procs[rank]).is_alive():
                    raise self._fail(
                        f"{self.name} rank {rank} died (exit code {proc.exitcode}) in {what}"
                    )
            if pending and time.monotonic() > deadline:
                raise self._fail(
                    f"{self.name} ranks {sorted(pending)} did not answer {what} in time"
                )
        return [answers[r] for r in range(self.world_size)]

    def _check_idle(self) -> None:
        if self.closed:
            raise WorkerError(f"the {self.name} worker processes were stopped")
        if self._exporting:
            # Rank 0 is waiting for the consumer of the stream, not for a command.
            raise RuntimeError(
                "an export_weights() iterator is still open: exhaust or close() it first"
            )

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method(*args, **kwargs)`` on every rank; returns the answers in rank order."""
        self._check_idle()
        for conn in self._conns:
            conn.send((method, args, kwargs))
        return self._gather(method)

    def export(self, method: str = "export_tensors", **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """Full tensors of the ranks' ``method(device="cpu", **kwargs)`` (``export_tensors``)
        from rank 0, one at a time (the next is gathered when asked for)."""
        self._check_idle()
        for conn in self._conns:
            conn.send(("export", (method, kwargs)))
        self._exporting = True
        finished = False
        try:
            while True:
                deadline = time.monotonic() + self.timeout_s
                kind, payload = self._recv(0, "export_weights", deadline)
                if kind == "done":
                    finished = True
                    break
                yield payload
                self._conns[0].send("next")
        finally:
            if not self.closed:
                if not finished:
                    # The consumer stopped early: tell rank 0, which tells the others.
                    self._conns[0].send("stop")
                    self._recv(0, "export_weights", time.monotonic() + self.timeout_s)
                deadline = time.monotonic() + self.timeout_s
                for rank in range(1, self.world_size):
                    self._recv(rank, "export_weights", deadline)
            self._exporting = False

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (asking them first when ``graceful``) and remove the store."""
        procs, self._procs = self._procs, []
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(("close", ()))
                except (BrokenPipeError, OSError):
                    pass
            for proc in procs:
                proc.join(timeout=30)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns = []
        shutil.rmtree(self._dir, ignore_errors=True)
