"""The colocated transport against real engine processes (the engine side Miles's embedded
engine serves, on a stand-in server over a tiny model) through SGLang's
``/update_weights_from_tensor``, with buckets in shared memory (CPU)."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.plugin import miles_register_transports
from miles_transport_colocated.sender import ColocatedSender
from miles_transport_common import testkit
from miles_transport_common.checksum import weights_hash
from miles_transport_common.errors import TransportError
from miles_transport_common.payload import HEADER, deserialize, reconstruct
from miles_transport_common.testing import named_stream, tiny_lm


@pytest.fixture
def engines():
    with testkit.engine_stand_ins(2) as started:
        yield started


def test_registration_and_contract() -> None:
    record = testkit.check_registration(
        miles_register_transports, "colocated", "colocated", "update_weights_from_tensor"
    )
    assert not record.receiver_factory  # the engine side is SGLang's endpoint
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
        metrics = testkit.sync_and_check(sender, engines, model, 1)
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
        # two more updates: the second set, then the first set again, while the engines serve
        # from the other one
        for version in (2, 3):
            testkit.sync_and_check(sender, engines, tiny_lm(version), version)
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
        sender.send(named_stream(model), version=1, engines=testkit.engine_urls(engines)[:1])
        testkit.assert_serves(engines[0], model, 1)
        assert max(b.numel() for b in sender.packer.buffers) > options.bucket_bytes
    finally:
        sender.close()


def test_corrupted_bucket_is_rejected_and_old_weights_kept(engines) -> None:
    torch.set_num_threads(1)
    with closing(ColocatedSender(ColocatedOptions(bucket_size_mb=0.5, timeout_s=60))) as sender:
        # the corrupted bucket's tensor is named, with the engine that found it
        match = r"rejected.*127\.0\.0\.1:\d+/update_weights_from_tensor -> HTTP 400.*tensor '"
        for r in testkit.send_corrupted(sender, engines, match):
            assert "checksum" in str(r["error"])
        assert sender.live_set == 1  # the set just sent never became live
        testkit.sync_and_check(sender, engines, tiny_lm(0), 2)


@pytest.mark.parametrize("memory", ["model", "bucket"])
def test_an_engine_serving_other_weights_than_sent_fails_the_send_naming_it(memory) -> None:
    # the check of the served weights: served from the verified bucket memory (memory="model")
    # and from staged copies, every tensor hashed again (memory="bucket")
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.5, timeout_s=60, memory=memory)
    with closing(ColocatedSender(options)) as sender:
        message = testkit.check_spoiled_engine_named(sender)
        assert "served checksum" in message


def test_verify_served_off_reaches_the_engine() -> None:
    # the option switches the check off on the engine: the spoiling engine's commit then passes
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.5, timeout_s=60, verify_served=False)
    engine = testkit.EngineStandIn(spoil=testkit.SPOILED)
    try:
        with closing(ColocatedSender(options)) as sender:
            sender.send(named_stream(tiny_lm(0)), version=1, engines=[engine.url])
        assert engine.report()["version"] == 1
    finally:
        engine.stop()


def test_engine_killed_mid_transfer_sender_raises_and_the_other_keeps_its_weights(engines) -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.25, timeout_s=8)
    with closing(ColocatedSender(options)) as sender:
        testkit.check_killed_engine_rejoins(sender, engines, options.timeout_s + 5)


def test_unreachable_engine_fails_fast_with_its_url() -> None:
    with (
        closing(ColocatedSender(ColocatedOptions(timeout_s=2))) as sender,
        pytest.raises(TransportError, match=r"127\.0\.0\.1:9"),
    ):
        sender.send(named_stream(tiny_lm(0)), version=1, engines=["http://127.0.0.1:9"])


def test_discovered_through_its_entry_point() -> None:
    testkit.check_entry_point("colocated", ColocatedOptions, "miles-transport-colocated")
