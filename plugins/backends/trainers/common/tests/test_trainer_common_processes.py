"""The worker processes (forks of a fork server on the CPU), driven with a toy rank class:
commands on every rank, errors and deaths raised in the controller under the backend's name,
export streaming, closing, the controller's environment."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from miles_trainer_common.processes import ProcessWorkers, WorkerError, class_path
from miles_trainer_common.ranks import rank_spec

pytestmark = pytest.mark.slow

# The rank class must be importable in the children: a module of its own on sys.path (a child
# gets the parent's sys.path).
TOY = """
import os

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    world_size: int = 2
    timeout_s: float = 120.0
    fail_on_init: bool = False


class ToyWorker:
    def __init__(self, options, rank, world_size, store_path):
        if options.fail_on_init and rank == 1:
            raise ValueError("rank 1 refuses to start")
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
        )

    def whoami(self):
        return self.rank, type(self.options).__name__, dist.get_world_size()

    def add(self, x):
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return float(t)

    def boom(self):
        if self.rank == 1:
            raise KeyError("boom on rank 1")
        return "fine"

    def die(self):
        if self.rank == 1:
            os._exit(3)
        return "alive"

    def getenv(self, name):
        return os.environ.get(name), os.getppid()

    def export_tensors(self, device=None):
        for i in range(3):
            t = torch.full((2,), float(self.rank))
            dist.all_reduce(t)  # every rank takes part in each gather
            yield f"t{i}", t + i
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    (tmp_path / "miles_toy_ranks.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield importlib.import_module("miles_toy_ranks")
    sys.modules.pop("miles_toy_ranks", None)


def _alive() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith("miles-toy")]


def test_commands_export_and_errors(toy: ModuleType) -> None:
    options = toy.ToyOptions()
    assert class_path(type(options)) == "miles_toy_ranks:ToyOptions"
    workers = ProcessWorkers(rank_spec(options, worker="miles_toy_ranks:ToyWorker", name="toy"))
    try:
        assert sorted(_alive()) == ["miles-toy-rank0", "miles-toy-rank1"]
        store_dir = workers._dir
        assert os.path.basename(store_dir).startswith("miles-toy-")
        # Each child validated the options with the options class and joined one group.
        assert workers.call("whoami") == [(0, "ToyOptions", 2), (1, "ToyOptions", 2)]
        assert workers.call("add", 3) == [6.0, 6.0]
        streamed = [(name, t.tolist()) for name, t in workers.export()]
        assert streamed == [("t0", [1.0, 1.0]), ("t1", [2.0, 2.0]), ("t2", [3.0, 3.0])]
        # While a stream is open, rank 0 waits for its consumer: other calls are refused.
        stream = workers.export()
        assert next(stream)[0] == "t0"
        with pytest.raises(RuntimeError, match="still open"):
            workers.call("add", 1)
        stream.close()  # stops every rank cleanly: they are in step again
        assert workers.call("add", 1) == [2.0, 2.0]
        with pytest.raises(WorkerError, match=r"toy rank 1 failed in boom:\n") as info:
            workers.call("boom")
        assert "KeyError: 'boom on rank 1'" in str(info.value)
        assert workers.closed and _alive() == [] and not os.path.exists(store_dir)
        with pytest.raises(WorkerError, match="the toy worker processes were stopped"):
            workers.call("add", 1)
    finally:
        workers.close()
    assert _alive() == []


def test_ranks_are_forks_with_the_controllers_environment(
    toy: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the ranks are forks of one fork server, started with the first trainer of
    the process; each takes the environment its controller has when it starts them, not the
    one the server started with."""
    spec = rank_spec(toy.ToyOptions(), worker="miles_toy_ranks:ToyWorker", name="toy")
    first = ProcessWorkers(spec)
    try:
        servers = {ppid for _, ppid in first.call("getenv", "MILES_TOY_MARK")}
    finally:
        first.close()
    monkeypatch.setenv("MILES_TOY_MARK", "set after the fork server started")
    workers = ProcessWorkers(spec)
    try:
        answers = workers.call("getenv", "MILES_TOY_MARK")
    finally:
        workers.close()
    assert [mark for mark, _ in answers] == ["set after the fork server started"] * 2
    assert {ppid for _, ppid in answers} == servers and servers != {os.getpid()}


def test_a_rank_that_dies_is_named(toy: ModuleType) -> None:
    workers = ProcessWorkers(
        rank_spec(toy.ToyOptions(), worker="miles_toy_ranks:ToyWorker", name="toy")
    )
    try:
        with pytest.raises(WorkerError, match=r"toy rank 1 died \(exit code 3\) in die"):
            workers.call("die")
        assert workers.closed
    finally:
        workers.close()
    assert _alive() == []


def test_a_rank_that_fails_to_start(toy: ModuleType) -> None:
    with pytest.raises(WorkerError, match=r"toy rank 1 failed in start:\n") as info:
        ProcessWorkers(
            rank_spec(
                toy.ToyOptions(fail_on_init=True),
                worker="miles_toy_ranks:ToyWorker",
                options_cls="miles_toy_ranks:ToyOptions",
                name="toy",
            )
        )
    assert "rank 1 refuses to start" in str(info.value)
    assert _alive() == []


def test_close_is_graceful(toy: ModuleType) -> None:
    workers = ProcessWorkers(
        rank_spec(toy.ToyOptions(), worker="miles_toy_ranks:ToyWorker", name="toy")
    )
    procs = list(workers._procs)
    workers.close()
    assert workers.closed and [p.exitcode for p in procs] == [0, 0]
    workers.close()  # twice is harmless
