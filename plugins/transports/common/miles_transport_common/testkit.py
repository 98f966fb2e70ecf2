"""What the transports' tests share, over :mod:`miles_transport_common.testing`: stand-in
engines started and stopped around a test, the check that an engine serves exactly a model, the
fault hooks that corrupt a bucket or kill an engine mid-transfer, and the checks of a transport's
registration and entry point. Each transport's tests state only what is its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

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

FaultHook = Callable[[Manifest, torch.Tensor], None]

#: the tensor a spoiling stand-in corrupts as it loads it (``EngineStandIn(spoil=...)``)
SPOILED = "blocks.1.3.weight"


@contextmanager
def engine_stand_ins(count: int = 2) -> Iterator[list[EngineStandIn]]:
    """``count`` stand-in engines (seed-1 weights, version 0); on exit every engine the list
    then holds is stopped, including one a test put in place of a killed one."""
    started = [EngineStandIn() for _ in range(count)]
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def engine_urls(engines: list[EngineStandIn]) -> list[str]:
    """The engines' URLs, in order."""
    return [e.url for e in engines]


def starting_hash() -> str:
    """The weights hash a stand-in serves when it starts (seed-1 weights)."""
    return weights_hash(named_stream(tiny_lm(1)))


def assert_serves(engine: EngineStandIn, model: torch.nn.Module, version: int) -> None:
    """The engine serves ``model`` at ``version``: same weights hash, and the same log-probs on
    a fixed input as the sender's copy computes."""
    r = engine.report()
    assert r["version"] == version
    assert r["hash"] == weights_hash(named_stream(model))
    lp = torch.tensor(r["logprobs"])
    assert torch.allclose(lp, logprobs(model, fixed_input()), atol=1e-5, rtol=0)


def sync_and_check(
    sender: Any, engines: list[EngineStandIn], model: torch.nn.Module, version: int
) -> dict[str, float]:
    """Send ``model`` as ``version`` to every engine and check that each then serves it;
    returns the sender's metrics."""
    metrics: dict[str, float] = sender.send(
        named_stream(model), version=version, engines=engine_urls(engines)
    )
    for engine in engines:
        assert_serves(engine, model, version)
    return metrics


def check_killed_engine_rejoins(sender: Any, engines: list[EngineStandIn], within_s: float) -> None:
    """Of two engines serving version 1, the second is SIGKILLed while bucket 3 of version 2
    goes out: the send raises (no engine committed it) within ``within_s`` seconds and the
    survivor still serves version 1; a new engine process (a new URL) in the dead one's place
    then receives version 3 with the survivor."""
    first = tiny_lm(0)
    sync_and_check(sender, engines, first, 1)
    sender.fault_hook = kill_engine(engines, 1, seq=3)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="no engine committed it"):
        sender.send(named_stream(tiny_lm(2)), version=2, engines=engine_urls(engines))
    assert time.monotonic() - t0 < within_s
    sender.fault_hook = None
    assert_serves(engines[0], first, 1)  # the survivor dropped the aborted update
    engines[1] = EngineStandIn()
    sync_and_check(sender, engines, tiny_lm(3), 3)


def assert_kept_starting_weights(engines: list[EngineStandIn]) -> list[dict[str, Any]]:
    """Every engine still serves what it started with (version 0); returns their reports."""
    reports = [e.report() for e in engines]
    for r in reports:
        assert r["version"] == 0 and r["hash"] == starting_hash()
    return reports


def send_corrupted(sender: Any, engines: list[EngineStandIn], match: str) -> list[dict[str, Any]]:
    """Version 1 of a seed-0 model goes out with bucket 2 corrupted after its checksum was
    computed: the send raises ``match`` and every engine keeps its starting weights. The fault
    hook is removed again; returns the engines' reports."""
    sender.fault_hook = corrupt_bucket(seq=2)
    with pytest.raises(TransportError, match=match):
        sender.send(named_stream(tiny_lm(0)), version=1, engines=engine_urls(engines))
    sender.fault_hook = None
    return assert_kept_starting_weights(engines)


def check_spoiled_engine_named(sender: Any) -> str:
    """Of two engines, the second corrupts tensor :data:`SPOILED` as it loads version 1 (every
    bucket arrived intact and verified): the send raises an error naming that engine's URL and
    the tensor, and that engine did not take the version. Returns the error's message."""
    engines = [EngineStandIn(), EngineStandIn(spoil=SPOILED)]
    try:
        with pytest.raises(TransportError) as failed:
            sender.send(named_stream(tiny_lm(0)), version=1, engines=engine_urls(engines))
        message = str(failed.value)
        assert engines[1].url in message and repr(SPOILED) in message, message
        assert engines[0].url not in message, message
        assert engines[1].report()["version"] == 0
        return message
    finally:
        for engine in engines:
            engine.stop()


def corrupt_bucket(seq: int = 2) -> FaultHook:
    """A fault hook that flips a byte of bucket ``seq`` after its checksum was computed."""

    def flip(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == seq:
            data[100] ^= 0xFF

    return flip


def kill_engine(engines: list[EngineStandIn], index: int, seq: int = 3) -> FaultHook:
    """A fault hook that SIGKILLs ``engines[index]`` when bucket ``seq`` is about to go out."""

    def kill(manifest: Manifest, data: torch.Tensor) -> None:
        if manifest.seq == seq:
            engines[index].kill()

    return kill


def check_registration(
    register_hook: Callable[[Callable[[Any], None]], None],
    name: str,
    placement: str,
    capability: str,
) -> Any:
    """The plugin's ``miles_register_transports`` registers one transport ``name`` that needs
    ``placement`` and the engine capability ``capability``, and whose default sender passes the
    core's component contract (then closed). Returns the record."""
    from miles_core.testing.contracts import check_component

    records: list[Any] = []
    register_hook(records.append)
    (record,) = records
    assert record.name == name
    assert record.requires == {"placement": [placement]}
    assert record.engine_capabilities == {capability}
    sender = check_component(record)
    sender.close()
    return record


def check_entry_point(name: str, config: type, distribution: str) -> None:
    """The installed distribution registers transport ``name`` with options ``config`` through
    its entry point, as the plugin manager discovers it."""
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    registry = load_plugins(autoload=True).registry
    assert registry.get(Kind.TRANSPORT, name).config is config
    assert registry.owner(Kind.TRANSPORT, name).distribution == distribution
