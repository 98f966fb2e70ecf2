"""The colocated transport against real engine processes (the engine side Miles's embedded
engine serves, on a stand-in server over a tiny model) through SGLang's
``/update_weights_from_tensor``, with buckets in shared memory (CPU)."""

from __future__ import annotations

import time

import pytest
import torch
from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.plugin import miles_register_transports
from miles_transport_colocated.sender import ColocatedSender
from miles_transport_common.bucketing import Manifest
from miles_transport_common.checksum import weights_hash
from miles_transport_common.errors import TransportError
from miles_transport_common.payload import HEADER, deserialize, reconstruct
from miles_transport_common.testing import (
    EngineStandIn,
    fixed_input,
    logprobs,
    named_stream,
    tiny_lm,
)

from miles_core.testing.contracts import check_component

OLD = weights_hash(named_stream(tiny_lm(1)))  # what a stand-in serves when it starts


@pytest.fixture
def engines():
    started = [EngineStandIn(), EngineStandIn()]
    yield started
    for e in started:
        e.stop()


def urls(engines: list[EngineStandIn]) -> list[str]:
    return [e.url for e in engines]


def assert_serves(engine: EngineStandIn, model: torch.nn.Module, version: int) -> None:
    r = engine.report()
    assert r["version"] == version
    assert r["hash"] == weights_hash(named_stream(model))
    lp = torch.tensor(r["logprobs"])
    assert torch.allclose(lp, logprobs(model, fixed_input()), atol=1e-5, rtol=0)


def test_registration_and_contract() -> None:
    records = []
    miles_register_transports(records.append)
    (record,) = records
    assert record.name == "colocated"
    assert record.requires == {"placement": ["colocated"]}
    assert record.engine_capabilities == {"update_weights_from_tensor"}
    assert not record.receiver_factory  # the engine side is SGLang's endpoint
    sender = check_component(record)
    sender.close()
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ColocatedOptions.model_validate({"bucket_size_mb": 0})
    with pytest.raises(ValueError, match="num_receivers"):
        ColocatedOptions.model_validate({"num_receivers": 2})  # the engines come with send


@pytest.mark.parametrize("memory", ["model", "bucket"])
def test_sync_two_engines_matches_sender(engines, memory: str) -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(
        bucket_size_mb=0.5, timeout_s=60, verify_weights_hash=True, memory=memory
    )
    sender = ColocatedSender(options)
    try:
        model = tiny_lm(0)
        metrics = sender.send(named_stream(model), version=1, engines=urls(engines))
        nbuckets = int(metrics["sync/buckets"])
        assert nbuckets >= 8  # a 5 MB model through 0.5 MiB buckets
        if memory == "bucket":
            # the sender's extra memory is its two shared bucket buffers, whatever the model (a
            # buffer grows to hold a tensor larger than a bucket whole: the MLP's 1 MiB weights)
            largest = max(t.numel() * t.element_size() for _, t in named_stream(model))
            assert sender.packer.allocated_bytes <= 2 * max(options.bucket_bytes, largest)
            assert len(sender.packer.buffers) == 2
        else:
            assert len(sender.sets[0].buffers) == nbuckets and not sender.sets[1].buffers
        for e in engines:
            assert_serves(e, model, 1)
        # two more updates: the second set, then the first set again, while the engines serve
        # from the other one
        for version in (2, 3):
            model = tiny_lm(version)
            sender.send(named_stream(model), version=version, engines=urls(engines))
            for e in engines:
                assert_serves(e, model, version)
        if memory == "model":
            assert len(sender.sets[1].buffers) == nbuckets  # no more than two sets, ever
    finally:
        sender.close()


def test_items_are_sglang_flattened_buckets() -> None:
    # What SGLang's model runner does with an item (load_format="flattened_bucket"):
    # deserialize, then flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape) per
    # metadata entry; the "miles" header is an extra key it never reads.
    from miles_transport_common.bucketing import BucketPacker
    from miles_transport_common.payload import bucket_payload, serialize, shared_cpu_buffer

    packer = BucketPacker(
        1 << 20, num_buffers=None, allocate=lambda s, n: shared_cpu_buffer(n), split=False
    )
    stream = named_stream(tiny_lm(0))
    got = {}
    for bucket in packer.pack(stream):
        item = deserialize(
            serialize(bucket_payload(bucket.data, bucket.manifest, {"op": "bucket"}))
        )
        assert item[HEADER] == {"op": "bucket"}
        for m in item["metadata"]:
            assert type(m).__module__ == "types"  # nothing of Miles needed to unpickle it
            t = item["flattened_tensor"][m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)
            assert m.numel == t.numel()
            got[m.name] = t
        assert dict(reconstruct(item["flattened_tensor"], item["metadata"])).keys() <= got.keys()
    assert weights_hash(got.items()) == weights_hash(stream)


def test_tensor_larger_than_a_bucket_travels_whole(engines) -> None:
    options = ColocatedOptions(bucket_size_mb=0.25, timeout_s=60, memory="bucket")
    sender = ColocatedSender(options)
    try:
        model = tiny_lm(4)  # its MLP weights are 1 MiB each
        sender.send(named_stream(model), version=1, engines=urls(engines)[:1])
        assert_serves(engines[0], model, 1)
        assert max(b.numel() for b in sender.packer.buffers) > options.bucket_bytes
    finally:
        sender.close()


def test_corrupted_bucket_is_rejected_and_old_weights_kept(engines) -> None:
    torch.set_num_threads(1)
    sender = ColocatedSender(ColocatedOptions(bucket_size_mb=0.5, timeout_s=60))

    def flip(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 2:
            data[100] ^= 0xFF  # after the checksum was computed

    try:
        sender.fault_hook = flip
        with pytest.raises(TransportError, match="rejected"):
            sender.send(named_stream(tiny_lm(0)), version=1, engines=urls(engines))
        for e in engines:
            r = e.report()
            assert r["version"] == 0 and r["hash"] == OLD
            assert "checksum" in str(r["error"])
        assert sender.live_set == 1  # the set just sent never became live
        sender.fault_hook = None
        model = tiny_lm(0)
        sender.send(named_stream(model), version=2, engines=urls(engines))
        for e in engines:
            assert_serves(e, model, 2)
    finally:
        sender.close()


def test_engine_killed_mid_transfer_sender_raises_and_the_other_keeps_its_weights(engines) -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.25, timeout_s=8)
    sender = ColocatedSender(options)
    first = tiny_lm(0)

    def kill(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 3:
            engines[1].kill()

    try:
        sender.send(named_stream(first), version=1, engines=urls(engines))
        sender.fault_hook = kill
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="no engine committed it"):
            sender.send(named_stream(tiny_lm(2)), version=2, engines=urls(engines))
        assert time.monotonic() - t0 < options.timeout_s + 5
        assert_serves(engines[0], first, 1)  # the survivor dropped the aborted update
        # the dead engine restarts (a new process, a new URL): the next update reaches it
        sender.fault_hook = None
        engines[1] = EngineStandIn()
        model = tiny_lm(3)
        sender.send(named_stream(model), version=3, engines=urls(engines))
        for e in engines:
            assert_serves(e, model, 3)
    finally:
        sender.close()


def test_unreachable_engine_fails_fast_with_its_url() -> None:
    sender = ColocatedSender(ColocatedOptions(timeout_s=2))
    try:
        with pytest.raises(TransportError, match=r"127\.0\.0\.1:9"):
            sender.send(named_stream(tiny_lm(0)), version=1, engines=["http://127.0.0.1:9"])
    finally:
        sender.close()


def test_discovered_through_its_entry_point() -> None:
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    registry = load_plugins(autoload=True).registry
    assert registry.get(Kind.TRANSPORT, "colocated").config is ColocatedOptions
    assert registry.owner(Kind.TRANSPORT, "colocated").distribution == "miles-transport-colocated"
