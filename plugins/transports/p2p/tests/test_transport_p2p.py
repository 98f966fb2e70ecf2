"""The p2p transport between real processes through real NIXL agents (UCX)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from miles_transport_common import testkit
from miles_transport_common.bucketing import Manifest
from miles_transport_common.checksum import weights_hash
from miles_transport_common.errors import TransportError
from miles_transport_common.testing import Worker, fixed_input, logprobs, named_stream, tiny_lm
from miles_transport_p2p.config import P2POptions
from miles_transport_p2p.plugin import miles_register_transports
from miles_transport_p2p.sender import P2PSender

from miles_core.testing.contracts import check_component

WORKER = str(Path(__file__).with_name("p2p_worker.py"))


def start(
    options: P2POptions,
    updates: int,
    stagings: tuple[str, ...] = ("full",),
    receivers: int = 1,
    spoil: tuple[str, ...] = (),
) -> tuple[P2PSender, list[Worker]]:
    sender = P2PSender(options, num_receivers=receivers)
    host, port = sender.address
    workers = [
        Worker(
            WORKER,
            options.model_copy(update={"staging": stagings[i % len(stagings)]}).model_dump_json(),
            host,
            str(port),
            str(updates),
            *spoil[i : i + 1],
        )
        for i in range(receivers)
    ]
    return sender, workers


def test_registration_and_contract() -> None:
    records = []
    miles_register_transports(records.append)
    (record,) = records
    assert record.name == "p2p"
    assert record.requires == {"placement": ["disaggregated"]}
    assert record.engine_capabilities == {"p2p_weights"}
    sender = check_component(record)
    sender.close()
    with pytest.raises(ValueError, match="bucket_size_mb"):
        P2POptions.model_validate({"bucket_size_mb": 0})


@pytest.mark.slow
@pytest.mark.parametrize("zero_copy", [True, False])
def test_sync_two_receivers_matches_sender(zero_copy: bool) -> None:
    # one receiver stages the whole update, the other loads bucket by bucket
    torch.set_num_threads(1)
    options = P2POptions(
        bucket_size_mb=0.5,
        timeout_s=60,
        verify_weights_hash=True,
        zero_copy=zero_copy,
    )
    model = tiny_lm(0)
    sender, workers = start(options, updates=3, stagings=("full", "bucket"), receivers=2)
    try:
        for w in workers:
            assert w.report()["version"] == 0
        metrics = sender.send(named_stream(model), version=1)
        assert metrics["sync/buckets"] >= 8  # a 5 MB model through 0.5 MiB buckets
        if zero_copy:  # nothing packed: the sender holds no bucket memory at all
            assert sender.packer.allocated_bytes == 0 and not sender._inflight
        else:  # two registered bucket buffers, whatever the model size
            assert sender.packer.allocated_bytes <= 2 * options.bucket_bytes
            assert len(sender.packer.buffers) == 2
        want_hash = weights_hash(named_stream(model))
        want_lp = logprobs(model, fixed_input())
        for w in workers:
            r = w.report()
            assert r["ok"] and r["version"] == 1
            assert r["hash"] == want_hash
            assert torch.allclose(torch.tensor(r["logprobs"]), want_lp, atol=1e-5, rtol=0)
        # two more updates: into the full-staging receiver's second set of regions, then its
        # first set again, while its model serves from the other set
        for version, seed in ((2, 2), (3, 3)):
            model_v = tiny_lm(seed)
            sender.send(named_stream(model_v), version=version)
            for w in workers:
                r = w.report()
                assert r["ok"] and r["version"] == version
                assert r["hash"] == weights_hash(named_stream(model_v))
    finally:
        sender.close()
        for w in workers:
            w.stop()


@pytest.mark.slow
def test_corrupted_bucket_is_rejected_and_old_weights_kept() -> None:
    torch.set_num_threads(1)
    options = P2POptions(bucket_size_mb=0.5, timeout_s=60)
    old_hash = weights_hash(named_stream(tiny_lm(1)))  # the receivers' initial weights
    model = tiny_lm(0)
    sender, workers = start(options, updates=2, receivers=2)

    def flip(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 2:
            data[100] ^= 0xFF  # after the checksum was computed

    try:
        for w in workers:
            w.report()
        sender.fault_hook = flip
        with pytest.raises(TransportError, match="rejected"):
            sender.send(named_stream(model), version=1)
        for w in workers:
            r = w.report()
            assert not r["ok"] and r["version"] == 0 and r["hash"] == old_hash
        sender.fault_hook = None
        sender.send(named_stream(model), version=2)
        for w in workers:
            r = w.report()
            assert r["ok"] and r["version"] == 2 and r["hash"] == weights_hash(named_stream(model))
    finally:
        sender.close()
        for w in workers:
            w.stop()


@pytest.mark.parametrize("staging", ["full", "bucket"])
def test_a_receiver_serving_other_weights_than_sent_fails_the_send_naming_it(staging) -> None:
    # the second receiver's loads corrupt one tensor after every bucket arrived intact
    torch.set_num_threads(1)
    options = P2POptions(bucket_size_mb=0.5, timeout_s=60, staging=staging)
    spoiled = testkit.SPOILED
    sender, workers = start(options, updates=1, receivers=2, spoil=("", spoiled))
    try:
        for w in workers:
            w.report()
        with pytest.raises(TransportError, match=rf"receiver \d.*{spoiled!r}.*served checksum"):
            sender.send(named_stream(tiny_lm(0)), version=1)
        reports = [w.report() for w in workers]
        assert spoiled in str(reports[1]["error"]) and reports[1]["version"] == 0
    finally:
        sender.close()
        for w in workers:
            w.stop()


@pytest.mark.slow
def test_receiver_killed_mid_transfer_sender_raises_within_timeout() -> None:
    torch.set_num_threads(1)
    options = P2POptions(bucket_size_mb=0.25, timeout_s=8)
    sender, (worker,) = start(options, updates=1)

    def kill(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 3:
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(10)

    try:
        worker.report()
        sender.fault_hook = kill
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            sender.send(named_stream(tiny_lm(0)), version=1)
        assert time.monotonic() - t0 < options.timeout_s + 5
    finally:
        sender.close()
        worker.stop()


def test_silent_receiver_times_out_with_clear_error() -> None:
    options = P2POptions(timeout_s=1)
    sender = P2PSender(options)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"timed out after 1 s waiting for 1 receiver"):
            sender.send(named_stream(tiny_lm(0)), version=1)
        assert time.monotonic() - t0 < 5
    finally:
        sender.close()


def test_discovered_through_its_entry_point() -> None:
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    registry = load_plugins(autoload=True).registry
    assert registry.get(Kind.TRANSPORT, "p2p").config is P2POptions
    assert registry.owner(Kind.TRANSPORT, "p2p").distribution == "miles-transport-p2p"
