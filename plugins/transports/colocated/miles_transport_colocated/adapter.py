"""An adapter through SGLang's LoRA API, the colocated way: the whole adapter packed into one
shared bucket and handed to every engine by handle."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch
from miles_transport_common import http
from miles_transport_common.bucketing import Allocator, BucketPacker, PackedBucket
from miles_transport_common.errors import BucketRejected, TransportError

from miles_core.contracts import AdapterSync


def pack_adapter(
    named: list[tuple[str, torch.Tensor]],
    adapter: AdapterSync,
    *,
    allocate: Allocator,
    hasher: Executor,
) -> tuple[BucketPacker, PackedBucket]:
    """Pack the adapter's tensors into one bucket of their total size (an adapter is small);
    returns the packer, whose buffer the caller frees, and the bucket."""
    if not named:
        raise ValueError(f"colocated transport: adapter {adapter.name!r} has no tensors")
    total = sum(t.numel() * t.element_size() for _, t in named)
    packer = BucketPacker(
        max(total, 4096),
        num_buffers=1,
        allocate=allocate,
        hasher=hasher,
        hash_inline=True,
        align=1,
        split=False,
    )
    buckets = []
    for bucket in packer.pack(named):
        bucket.ready()
        buckets.append(bucket)
    if len(buckets) != 1:  # cannot happen: the bound is the adapter's size
        raise TransportError(f"adapter {adapter.name!r} did not fit one bucket")
    return packer, buckets[0]


def publish_adapter(
    url: str,
    adapter: AdapterSync,
    version: int,
    items: Callable[[str], list[Any]],
    timeout_s: float,
) -> None:
    """Load the adapter on the engine at ``url`` (``/load_lora_adapter_from_tensors`` with the
    serialized bucket items ``items(url)``, one per rank) and stamp ``version`` on it
    (``/update_weight_version``). An engine that refuses a name it already serves (SGLang)
    gets ``/unload_lora_adapter`` and the load again."""
    config = dict(adapter.config)

    def load() -> None:
        body = {
            "lora_name": adapter.name,
            "config_dict": config,
            "serialized_named_tensors": items(url),
            "load_format": "flattened_bucket",
            "pinned": False,
        }
        http.call(url, "/load_lora_adapter_from_tensors", body, timeout_s=timeout_s)

    try:
        load()
    except BucketRejected as exc:
        if "already" not in str(exc):  # SGLang: the name is taken
            raise
        http.call(url, "/unload_lora_adapter", {"lora_name": adapter.name}, timeout_s=timeout_s)
        load()
    http.call(
        url,
        "/update_weight_version",
        {"new_version": str(version), "abort_all_requests": False},
        timeout_s=timeout_s,
    )
