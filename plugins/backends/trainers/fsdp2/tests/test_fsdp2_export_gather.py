"""The export's gather to rank 0 (:func:`gathered_on_first`) on a real gloo group of three
spawned processes: the whole tensor on rank 0 equals ``full_tensor()`` for every split (even,
uneven, a rank holding nothing, a shard along another dimension), and the other ranks get an
empty tensor; a tensor that is not sharded stays whole. The worker's export gathers into the
memory of its last export only while its consumer copies what it gets."""

from __future__ import annotations

import socket
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD = 3
SHAPES = [
    ((9, 4), 0),
    ((7, 5), 0),
    ((2, 3), 0),
    ((1,), 0),
    ((0, 4), 0),
    ((4, 7), 1),
    ((3, 2, 5), 1),
]


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    from miles_backend_fsdp2.worker import _chunks, gathered_on_first
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        mesh = init_device_mesh("cpu", (WORLD,))
        results = []
        for i, (shape, dim) in enumerate(SHAPES):
            whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + i
            t = distribute_tensor(whole, mesh, [Shard(dim)])
            assert t.to_local().shape[dim] == _chunks(shape[dim], WORLD)[rank]
            got = gathered_on_first(t)
            results.append((shape, got.shape, bool(torch.equal(got, t.full_tensor()))))
        rep = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])  # not sharded: whole
        results.append(("replicated", gathered_on_first(rep).shape, True))
        out.put((rank, results, _exports_into_kept(mesh) if rank == 0 else _follow(mesh)))
        dist.barrier()
    except BaseException:
        out.put((rank, [], {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exports(mesh: Any, into_kept: bool, state: Any) -> list[dict[str, torch.Tensor]]:
    """Two exports of a sharded table through the worker's stream, the shards changed
    between them (a training step); ``state``: the worker's, kept across the exports."""
    from miles_backend_fsdp2.worker import RankWorker
    from torch.distributed.tensor import Shard, distribute_tensor

    table = distribute_tensor(torch.arange(40.0).reshape(10, 4), mesh, [Shard(0)])
    state.export_into_kept = into_kept
    got = []
    for _ in range(2):
        got.append(dict(RankWorker._stream(state, iter([("table", table)]), None)))
        table.to_local().add_(100)
    return got


def _state() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(options=SimpleNamespace(export_dtype=None), _exported={})


def _exports_into_kept(mesh: Any) -> dict[str, Any]:
    """Rank 0: what the second export shares with the first, with and without reuse."""
    seen = {}
    for into_kept in (False, True):
        first, second = _exports(mesh, into_kept, _state())
        a, b = first["table"], second["table"]
        expected = torch.arange(40.0).reshape(10, 4) + 100
        seen[into_kept] = {
            "same_memory": a.data_ptr() == b.data_ptr(),
            "second_right": bool(torch.equal(b, expected)),
            "first_kept": bool(torch.equal(a, expected - 100)),
        }
    return {"error": None, "seen": seen}


def _follow(mesh: Any) -> dict[str, Any]:
    for into_kept in (False, True):
        _exports(mesh, into_kept, _state())
    return {"error": None}


def test_gathered_on_first_is_the_whole_tensor_on_rank_0_only() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        answers = dict(
            (rank, (res, err)) for rank, res, err in (out.get(timeout=120) for _ in procs)
        )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(WORLD):
        results, said = answers[rank]
        assert said["error"] is None, said["error"]
        assert len(results) == len(SHAPES) + 1
        for shape, got, equal in results:
            if shape == "replicated":
                assert got == (4, 2)
            elif rank == 0:
                assert got == torch.Size(shape) and equal, shape
            else:
                assert got == (0,), (rank, shape)  # the other ranks: nothing gathered
    # an export whose consumer copies (a rank's sender, Ray's object store) gathers into the
    # memory of the last one; any other leaves what it yielded alone
    seen = answers[0][1]["seen"]
    assert seen[True] == {"same_memory": True, "second_right": True, "first_kept": False}
    assert seen[False] == {"same_memory": False, "second_right": True, "first_kept": True}
