"""The broadcast transport against real engine processes (the engine side Miles's embedded
engine serves, on a stand-in server over a tiny model) through SGLang's
``/init_weights_update_group`` and ``/update_weights_from_distributed``, over a real gloo group."""

from __future__ import annotations

import time
from contextlib import closing

import pytest
import torch
from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.plugin import miles_register_transports
from miles_transport_broadcast.sender import BroadcastSender
from miles_transport_common import testkit
from miles_transport_common.errors import TransportError
from miles_transport_common.testing import named_stream, tiny_lm


@pytest.fixture
def engines():
    with testkit.engine_stand_ins(2) as started:
        yield started


def test_registration_and_contract() -> None:
    testkit.check_registration(
        miles_register_transports, "broadcast", "disaggregated", "update_weights_from_distributed"
    )
    with pytest.raises(ValueError, match="backend"):
        BroadcastOptions.model_validate({"backend": "mpi"})


def test_sync_two_engines_matches_sender(engines) -> None:
    torch.set_num_threads(1)
    options = BroadcastOptions(bucket_size_mb=0.5, timeout_s=60)
    sender = BroadcastSender(options)
    try:
        for version in (1, 2, 3):
            model = tiny_lm(version)
            metrics = testkit.sync_and_check(sender, engines, model, version)
            assert metrics["sync/buckets"] >= 8  # a 5 MB model through 0.5 MiB buckets
        assert sender.groups_formed == 1  # one group for as long as the engines stay
        # two bucket buffers, each at most the larger of a bucket and the largest tensor
        largest = max(t.numel() * t.element_size() for _, t in named_stream(model))
        assert sender.packer.allocated_bytes <= 2 * max(options.bucket_bytes, largest)
        assert len(sender.packer.buffers) == 2
    finally:
        sender.close()


def test_corrupted_bucket_is_rejected_and_old_weights_kept(engines) -> None:
    torch.set_num_threads(1)
    with closing(BroadcastSender(BroadcastOptions(bucket_size_mb=0.5, timeout_s=60))) as sender:
        testkit.send_corrupted(
            sender,
            engines,
            r"rejected.*engine http://127\.0\.0\.1:\d+ received tensor '.*different",
        )
        # the next update forms a new group, which drops what the engines staged
        testkit.sync_and_check(sender, engines, tiny_lm(0), 2)
        assert sender.groups_formed == 2


def test_an_engine_serving_other_weights_than_sent_fails_the_send_naming_it() -> None:
    torch.set_num_threads(1)
    with closing(BroadcastSender(BroadcastOptions(bucket_size_mb=0.5, timeout_s=60))) as sender:
        assert "served checksum" in testkit.check_spoiled_engine_named(sender)


def test_engine_killed_mid_transfer_sender_raises_then_regroups(engines) -> None:
    torch.set_num_threads(1)
    options = BroadcastOptions(bucket_size_mb=0.25, timeout_s=8)
    with closing(BroadcastSender(options)) as sender:
        # the restarted engine (a new process, a new URL) joins a new group with the survivor
        testkit.check_killed_engine_rejoins(sender, engines, 2 * options.timeout_s + 5)


def test_missing_engine_fails_within_the_timeout() -> None:
    options = BroadcastOptions(timeout_s=2)
    sender = BroadcastSender(options)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"127\.0\.0\.1:9"):
            sender.send(named_stream(tiny_lm(0)), version=1, engines=["http://127.0.0.1:9"])
        assert time.monotonic() - t0 < 10
    finally:
        sender.close()


def test_discovered_through_its_entry_point() -> None:
    testkit.check_entry_point("broadcast", BroadcastOptions, "miles-transport-broadcast")
