"""A trainer's ranks as processes on this machine, driven over pipes: the default
:class:`~miles_trainer_common.ranks.Ranks` (a placement may start them elsewhere).

The controller sends every rank the same command and waits for all answers; any rank's error
or death stops all workers and is raised in the controller with the rank's traceback (the
other ranks may be blocked in a collective, so the group cannot be trusted afterwards).
Tensors cross the pipes through torch's shared-memory pickling.

Backend-blind: each child builds its rank from the :class:`~miles_trainer_common.ranks.RankSpec`
(:func:`~miles_trainer_common.ranks.build_rank`), rendezvousing on a
``torch.distributed.FileStore`` in a temporary folder. A command ``(method, args, kwargs)``
runs ``worker.method(*args, **kwargs)``; ``export`` streams
:func:`~miles_trainer_common.ranks.collective_export` from rank 0.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.multiprocessing as mp
from torch import Tensor

from miles_core.forks import adopt_environment, preloaded
from miles_trainer_common.ranks import RankSpec, build_rank, class_path, collective_export, resolve

__all__ = ["ProcessWorkers", "WorkerError", "class_path", "resolve", "worker_main"]


class WorkerError(RuntimeError):
    """A worker process failed; the trainer's processes have been stopped."""


def _export(worker: Any, conn: Any, method: str, kwargs: dict[str, Any]) -> None:
    """Stream the collective export to the controller from rank 0, one tensor at a time: after
    each, rank 0 waits for the controller's ``next`` or ``stop`` (which stops every rank)."""
    stream = collective_export(worker, method, kwargs)
    for pair in stream:  # rank 0 alone gets tensors
        conn.send(("tensor", pair))
        if conn.recv() != "next":
            stream.close()
            break
    conn.send(("done", None))


def worker_main(spec: RankSpec, rank: int, store: str, conn: Any, environ: dict[str, str]) -> None:
    """Entry point of one worker process: build rank ``rank`` of ``spec``, then serve commands
    until ``close``. ``environ``: the controller's environment when it started the ranks (a
    fork server's forks would have the one of the server's start)."""
    import torch.distributed as dist

    adopt_environment(environ)
    try:
        worker = build_rank(spec, rank, store)
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
                _export(worker, conn, *args)
                continue
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


def _context(spec: RankSpec) -> Any:
    """Where ranks come from. On the CPU: a fork server of this process that imported torch,
    this module and the backend's rank and options modules once (a spawned rank spent most of
    its start importing them; :mod:`miles_core.forks`). On CUDA: spawned, each from
    nothing."""
    if spec.options.get("device", "cpu") != "cpu":
        return mp.get_context("spawn")
    return preloaded(
        [__name__, *(path.partition(":")[0] for path in (spec.worker, spec.options_cls))]
    )


class ProcessWorkers:
    """The controller side: starts ``spec.world_size`` ranks as processes of this machine
    and runs commands on all of them. Errors name the backend (``"{name} rank 1 died ..."``);
    the processes are named ``miles-{name}-rank{r}``."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.world_size = spec.world_size
        self._dir = tempfile.mkdtemp(prefix=f"miles-{spec.name}-")
        ctx = _context(spec)
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._exporting = False
        store = os.path.join(self._dir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(spec, rank, store, child, dict(os.environ)),
                name=f"miles-{spec.name}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._gather("start")

    @property
    def timeout_s(self) -> float:
        """The longest a rank may stay silent in one command."""
        return self.spec.timeout_s

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
