"""The broadcast transport against real engine processes (the engine side Miles's embedded
engine serves, on a stand-in server over a tiny model) through SGLang's
``/init_weights_update_group`` and ``/update_weights_from_distributed``, over a real gloo group."""

from __future__ import annotations

import time

import pytest
import torch
from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.plugin import miles_register_transports
from miles_transport_broadcast.sender import BroadcastSender
from miles_transport_common.bucketing import Manifest
from miles_transport_common.checksum import weights_hash
from miles_transport_common.errors import TransportError
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
    assert record.name == "broadcast"
    assert record.requires == {"placement": ["disaggregated"]}
    assert record.engine_capabilities == {"update_weights_from_distributed"}
    sender = check_component(record)
    sender.close()
    with pytest.raises(ValueError, match="backend"):
        BroadcastOptions.model_validate({"backend": "mpi"})


def test_sync_two_engines_matches_sender(engines) -> None:
    torch.set_num_threads(1)
    options = BroadcastOptions(bucket_size_mb=0.5, timeout_s=60)
    sender = BroadcastSender(options)
    try:
        for version in (1, 2, 3):
            model = tiny_lm(version)
            metrics = sender.send(named_stream(model), version=version, engines=urls(engines))
            assert metrics["sync/buckets"] >= 8  # a 5 MB model through 0.5 MiB buckets
            for e in engines:
                assert_serves(e, model, version)
        assert sender.groups_formed == 1  # one group for as long as the engines stay
        # two bucket buffers, each at most the larger of a bucket and the largest tensor
        largest = max(t.numel() * t.element_size() for _, t in named_stream(model))
        assert sender.packer.allocated_bytes <= 2 * max(options.bucket_bytes, largest)
        assert len(sender.packer.buffers) == 2
    finally:
        sender.close()


def test_corrupted_bucket_is_rejected_and_old_weights_kept(engines) -> None:
    torch.set_num_threads(1)
    sender = BroadcastSender(BroadcastOptions(bucket_size_mb=0.5, timeout_s=60))

    def flip(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == 2:
            data[100] ^= 0xFF  # after the checksum was computed

    try:
        sender.fault_hook = flip
        with pytest.raises(TransportError, match=r"rejected.*different checksum"):
            sender.send(named_stream(tiny_lm(0)), version=1, engines=urls(engines))
        for e in engines:
            r = e.report()
            assert r["version"] == 0 and r["hash"] == OLD
        # the next update forms a new group, which drops what the engines staged
        sender.fault_hook = None
        model = tiny_lm(0)
        sender.send(named_stream(model), version=2, engines=urls(engines))
        assert sender.groups_formed == 2
        for e in engines:
            assert_serves(e, model, 2)
    finally:
        sender.close()


def test_engine_killed_mid_transfer_sender_raises_then_regroups(engines) -> None:
    torch.set_num_threads(1)
    options = BroadcastOptions(bucket_size_mb=0.25, timeout_s=8)
    sender = BroadcastSender(options)
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
        assert time.monotonic() - t0 < 2 * options.timeout_s + 5
        sender.fault_hook = None
        r = engines[0].report()
        assert r["version"] == 1 and r["hash"] == weights_hash(named_stream(first))
        # the engine restarts (a new process, a new URL): a new group includes it
        engines[1] = EngineStandIn()
        model = tiny_lm(3)
        sender.send(named_stream(model), version=3, engines=urls(engines))
        for e in engines:
            assert_serves(e, model, 3)
    finally:
        sender.close()


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
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    registry = load_plugins(autoload=True).registry
    assert registry.get(Kind.TRANSPORT, "broadcast").config is BroadcastOptions
    assert registry.owner(Kind.TRANSPORT, "broadcast").distribution == "miles-transport-broadcast"
