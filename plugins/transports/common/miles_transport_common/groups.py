"""The process group of a distributed weight update, formed exactly as SGLang forms it.

SGLang's ``POST /init_weights_update_group`` joins a group through its
``init_custom_process_group``: a ``tcp://master_address:master_port`` rendezvous whose rank 0
hosts the TCP store, the store wrapped in ``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` (which prefixes ``group_name/`` and the device again). Both sides
of Miles's broadcast transport, the trainer's rank 0 and the embedded engine's endpoint, form
their group through :func:`join_update_group`, which does the same, so the trainer meets a real
SGLang engine and the embedded engine meets an SGLang-style trainer on the same store keys.
The group never touches torch.distributed's default group.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def master_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCP store at ``host:port`` (``port`` 0 picks a free one: read ``.port``); it
    does not wait for the other ranks."""
    return dist.TCPStore(
        host, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    store: dist.Store | None = None,
) -> Any:
    """Join (rank 0: form) the weight-update group ``group_name``; blocks until every rank
    joined or ``timeout_s`` passed. Rank 0 passes its :func:`master_store`; the other ranks
    reach it through the ``tcp://`` rendezvous."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefixed,
        group_name=group_name,
        **{options: None},
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_update_group(pg: Any) -> None:
    """Destroy a group made by :func:`join_update_group` (a broken one included)."""
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a group whose peer died may not shut down cleanly: nothing to keep
        pass
