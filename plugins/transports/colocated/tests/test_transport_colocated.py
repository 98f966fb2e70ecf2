"""The colocated transport between real processes over shared memory (CPU)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.plugin import miles_register_transports
from miles_transport_colocated.sender import ColocatedSender
from miles_transport_common.bucketing import Manifest
from miles_transport_common.checksum import weights_hash
from miles_transport_common.errors import TransportError
from miles_transport_common.testing import Worker, fixed_input, logprobs, named_stream, tiny_lm

from miles_core.testing.contracts import check_component

WORKER = str(Path(__file__).with_name("colocated_worker.py"))


def start(
    options: ColocatedOptions, updates: int, stagings: tuple[str, ...] = ("full",)
) -> tuple[ColocatedSender, list[Worker]]:
    sender = ColocatedSender(options)
    host, port = sender.address
    workers = [
        Worker(
            WORKER,
            options.model_copy(update={"staging": stagings[i % len(stagings)]}).model_dump_json(),
            host,
            str(port),
            str(updates),
        )
        for i in range(options.num_receivers)
    ]
    return sender, workers


def test_registration_and_contract() -> None:
    records = []
    miles_register_transports(records.append)
    (record,) = records
    assert record.name == "colocated"
    assert record.requires == {"placement": ["colocated"]}
    sender = check_component(record)
    sender.close()
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ColocatedOptions.model_validate({"bucket_size_mb": 0})


@pytest.mark.parametrize("memory", ["model", "bucket"])
def test_sync_two_receivers_matches_sender(memory: str) -> None:
    # one receiver stages the whole update, the other loads bucket by bucket
    torch.set_num_threads(1)
    options = ColocatedOptions(
        bucket_size_mb=0.5,
        num_receivers=2,
        timeout_s=60,
        verify_weights_hash=True,
        memory=memory,
    )
    model = tiny_lm(0)
    sender, workers = start(options, updates=3, stagings=("full", "bucket"))
    try:
        for w in workers:
            assert w.report()["version"] == 0
        metrics = sender.send(named_stream(model), version=1)
        nbuckets = int(metrics["sync/buckets"])
        assert nbuckets >= 8  # a 5 MB model through 0.5 MiB buckets
        if memory == "bucket":
            # the sender's extra memory is its two shared bucket buffers, whatever the model
            assert sender.packer.allocated_bytes <= 2 * options.bucket_bytes
            assert len(sender.packer.buffers) == 2
        else:
            assert len(sender.sets[0].buffers) == nbuckets and not sender.sets[1].buffers
        want_hash = weights_hash(named_stream(model))
        want_lp = logprobs(model, fixed_input())
        for w in workers:
            r = w.report()
            assert r["ok"] and r["version"] == 1
            assert r["hash"] == want_hash
            assert torch.allclose(torch.tensor(r["logprobs"]), want_lp, atol=1e-5, rtol=0)
        # two more updates: the second set, then the first set again, while receivers serve
        # from the other one
        for version, seed in ((2, 2), (3, 3)):
            model_v = tiny_lm(seed)
            sender.send(named_stream(model_v), version=version)
            for w in workers:
                r = w.report()
                assert r["ok"] and r["version"] == version
                assert r["hash"] == weights_hash(named_stream(model_v))
                lp = torch.tensor(r["logprobs"])
                assert torch.allclose(lp, logprobs(model_v, fixed_input()), atol=1e-5, rtol=0)
        if memory == "model":
            assert len(sender.sets[1].buffers) == nbuckets  # no more than two sets, ever
            assert len(sender.shared) == 2 * nbuckets
    finally:
        sender.close()
        for w in workers:
            w.stop()


def test_rejected_update_leaves_receivers_serving_the_live_set() -> None:
    # memory="model": update 1 lands in set 0; update 2 (set 1) is corrupted and rejected; the
    # receivers keep serving set 0, and update 3 goes to set 1 again, never touching set 0
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.5, num_receivers=1, timeout_s=60)
    sender, (worker,) = start(options, updates=3)

    def flip(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 1:
            data[10] ^= 0x55

    try:
        worker.report()
        sender.send(named_stream(tiny_lm(0)), version=1)
        assert worker.report()["hash"] == weights_hash(named_stream(tiny_lm(0)))
        sender.fault_hook = flip
        with pytest.raises(TransportError, match="rejected"):
            sender.send(named_stream(tiny_lm(2)), version=2)
        r = worker.report()
        assert not r["ok"] and r["version"] == 1
        assert r["hash"] == weights_hash(named_stream(tiny_lm(0)))
        assert sender.live_set == 0
        sender.fault_hook = None
        sender.send(named_stream(tiny_lm(3)), version=3)
        r = worker.report()
        assert r["ok"] and r["version"] == 3 and r["hash"] == weights_hash(named_stream(tiny_lm(3)))
        assert sender.live_set == 1
    finally:
        sender.close()
        worker.stop()


def test_corrupted_bucket_is_rejected_and_old_weights_kept() -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.5, num_receivers=2, timeout_s=60)
    old_hash = weights_hash(named_stream(tiny_lm(1)))  # the receivers' initial weights
    model = tiny_lm(0)
    sender, workers = start(options, updates=2)

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


def test_receiver_killed_mid_transfer_sender_raises_within_timeout() -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.25, num_receivers=1, timeout_s=8)
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
    options = ColocatedOptions(num_receivers=1, timeout_s=1)
    sender = ColocatedSender(options)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"timed out after 1 s waiting for 1 receiver"):
            sender.send(named_stream(tiny_lm(0)), version=1)
        assert time.monotonic() - t0 < 5
    finally:
        sender.close()


def test_stalled_sender_receiver_times_out_and_keeps_old_weights() -> None:
    torch.set_num_threads(1)
    options = ColocatedOptions(bucket_size_mb=0.5, num_receivers=1, timeout_s=30)
    old_hash = weights_hash(named_stream(tiny_lm(1)))
    sender = ColocatedSender(options)
    host, port = sender.address
    fast = options.model_copy(update={"timeout_s": 2.0}).model_dump_json()
    worker = Worker(WORKER, fast, host, str(port), "1")

    def stall(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 2:
            time.sleep(4)

    try:
        worker.report()
        sender.fault_hook = stall
        with pytest.raises(TransportError):
            sender.send(named_stream(tiny_lm(0)), version=1)
        r = worker.report()
        assert not r["ok"] and r["version"] == 0 and r["hash"] == old_hash
        assert "timed out after 2 s waiting for the next bucket" in str(r["error"])
    finally:
        sender.close()
        worker.stop()


def test_discovered_through_its_entry_point() -> None:
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    registry = load_plugins(autoload=True).registry
    assert registry.get(Kind.TRANSPORT, "colocated").config is ColocatedOptions
    assert registry.owner(Kind.TRANSPORT, "colocated").distribution == "miles-transport-colocated"
