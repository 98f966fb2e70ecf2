"""Engines joining and leaving a running job (:mod:`miles_core.runtime.elastic`) and the
requests that ask for it (:mod:`miles_core.runtime.control`, ``miles fleet``), against fake
engines: what each engine is asked, in what order, and what the fleet serves after."""

from __future__ import annotations

import asyncio
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import pytest
from core_support import IdleEngineClient

from miles_core.cli import main
from miles_core.errors import MilesUserError
from miles_core.runtime.control import MAX_REQUEST_BYTES, Control, control_dir, request
from miles_core.runtime.fleet import EngineFleet


class Client(IdleEngineClient):
    def __init__(self, url: str, calls: list[tuple[str, str]]) -> None:
        super().__init__(url)
        self.calls = calls

    async def pause_generation(self, mode: str) -> None:
        self.calls.append((self.base_url, f"pause:{mode}"))

    async def continue_generation(self) -> None:
        self.calls.append((self.base_url, "continue"))


class Launcher:
    def __init__(self, num_engines: int, fail: set[int] | None = None) -> None:
        self.num_engines = num_engines
        self.fail = fail or set()
        self.launches: list[int] = []
        self.stops: list[int] = []
        self.calls: list[tuple[str, str]] = []

    def launch(self, model_path: str, index: int) -> str:
        self.launches.append(index)
        if index in self.fail and self.launches.count(index) > 1:  # its restart fails
            raise RuntimeError(f"no node has room for engine {index}")
        return f"http://engine-{index}-{len(self.launches)}"

    def client(self, url: str) -> Client:
        return Client(url, self.calls)

    def stop(self, index: int) -> None:
        self.stops.append(index)


class Transport:
    def __init__(self) -> None:
        self.sends: list[list[str]] = []

    def send(self, weights: Any, *, version: int, engines: list[str]) -> dict[str, float]:
        self.sends.append(list(engines))
        return {"bytes": 1.0}


class PeerClient(Client):
    """A client whose engine copies a peer's weights (``weights_from_peer``): it then serves
    the version the fake peer reports, unless ``answer`` says otherwise."""

    answer: ClassVar[dict[str, Any] | Exception | None] = None
    versions: ClassVar[dict[str, int]] = {}

    async def pull_weights(self, source: str, *, timeout_s: float) -> dict[str, Any]:
        self.calls.append((self.base_url, f"pull:{source}"))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer or {"weight_version": str(self.versions[source]), "bytes": 10.0}


class PeerLauncher(Launcher):
    def client(self, url: str) -> Client:
        return PeerClient(url, self.calls)


def fleet_of(
    launcher: Launcher, transport: Transport | None = None, peer_copy: bool = False
) -> EngineFleet:
    return EngineFleet(
        launcher,  # type: ignore[arg-type]
        transport or Transport(),  # type: ignore[arg-type]
        model_path="m",
        weights=lambda: nullcontext([]),
        log=lambda line: None,
        peer_copy=peer_copy,
    )


def test_a_joined_engine_serves_from_the_next_update_and_pauses_nobody() -> None:
    launcher, transport = Launcher(1), Transport()
    fleet = fleet_of(launcher, transport)

    async def go() -> None:
        await fleet.start(0)
        await fleet.publish(1, pause="abort")
        assert fleet.membership.join(1) == [1]
        await fleet.membership.joins_done()
        joined = fleet.engines[1]
        assert joined.down and joined.restarted and fleet.urls() == ["http://engine-0-1"]
        assert len(fleet.routes) == 2 and fleet.routes[1].down  # no request goes to it yet
        await fleet.publish(2, pause="abort")
        assert not joined.down and joined.version == 2
        assert fleet.urls() == ["http://engine-0-1", "http://engine-1-2"]

    asyncio.run(go())
    assert transport.sends == [["http://engine-0-1"], ["http://engine-0-1", "http://engine-1-2"]]
    # the serving engine paused for each update as before; the joining one was never paused
    assert [c for c in launcher.calls if c[0] == "http://engine-1-2"] == []
    assert fleet.membership.joined == 1 and fleet.membership.left == 0


def test_a_joined_engine_copies_a_serving_engines_weights_and_serves_at_once() -> None:
    launcher, transport = PeerLauncher(2), Transport()
    fleet = fleet_of(launcher, transport, peer_copy=True)

    async def go() -> None:
        await fleet.start(0)
        await fleet.publish(1, pause="abort")
        PeerClient.versions = {"http://engine-0-1": 1}
        assert fleet.membership.join(1) == [2]
        await fleet.membership.joins_done()
        joined = fleet.engines[2]
        assert not joined.down and joined.version == 1  # no update was needed
        assert fleet.urls() == ["http://engine-0-1", "http://engine-1-2", "http://engine-2-3"]

    asyncio.run(go())
    assert transport.sends == [["http://engine-0-1", "http://engine-1-2"]]  # the one update
    # it copied engine 0's weights; nobody paused for it
    assert ("http://engine-2-3", "pull:http://engine-0-1") in launcher.calls
    pauses = [c for c in launcher.calls if c[1].startswith("pause")]
    assert pauses == [("http://engine-0-1", "pause:abort"), ("http://engine-1-2", "pause:abort")]
    assert fleet.membership.copied == 1 and fleet.membership.last_copy["source"] == 0


@pytest.mark.parametrize(
    "answer", [RuntimeError("the peer refused"), {"weight_version": "0", "bytes": 1.0}]
)
def test_a_failed_copy_leaves_the_joined_engine_to_the_next_update(answer: Any) -> None:
    launcher, transport = PeerLauncher(1), Transport()
    fleet = fleet_of(launcher, transport, peer_copy=True)
    PeerClient.answer = answer
    try:

        async def go() -> None:
            await fleet.start(0)
            await fleet.publish(1, pause="abort")
            fleet.membership.join(1)
            await fleet.membership.joins_done()
            joined = fleet.engines[1]
            assert joined.down and joined.restarted  # it waits, as without the copy
            await fleet.publish(2, pause="abort")
            assert not joined.down and joined.version == 2

        asyncio.run(go())
    finally:
        PeerClient.answer = None
    assert fleet.membership.copied == 0


def test_a_drained_engine_ends_its_requests_and_stops() -> None:
    launcher = Launcher(2)
    fleet = fleet_of(launcher)

    async def go() -> None:
        await fleet.start(0)
        await fleet.membership.leave(fleet.membership.find(1), "drained")

    asyncio.run(go())
    assert [e.index for e in fleet.engines] == [0] and len(fleet.routes) == 1
    assert ("http://engine-1-2", "pause:abort") in launcher.calls
    assert launcher.stops == [1] and fleet.membership.left == 1
    with pytest.raises(MilesUserError, match=r"no engine 1 in this job; its engines are \[0\]"):
        fleet.membership.find(1)


def test_an_engine_that_cannot_be_restarted_leaves_while_another_serves() -> None:
    launcher = Launcher(2, fail={1})
    fleet = fleet_of(launcher)

    async def go() -> None:
        await fleet.start(0)
        fleet.begin_restart(fleet.engines[1])
        await asyncio.gather(*list(fleet._restarts), return_exceptions=True)
        assert fleet.failure is not None and not fleet.failure.done()  # the run goes on

    asyncio.run(go())
    assert [e.index for e in fleet.engines] == [0] and fleet.membership.left == 1


def test_the_last_engine_that_cannot_be_restarted_fails_the_run() -> None:
    fleet = fleet_of(Launcher(1, fail={0}))

    async def go() -> None:
        await fleet.start(0)
        fleet.begin_restart(fleet.engines[0])
        with pytest.raises(RuntimeError, match="no node has room for engine 0"):
            await fleet.restarts_done()

    asyncio.run(go())


def test_requests_in_the_run_folder_are_applied_in_order(tmp_path: Path) -> None:
    launcher = Launcher(2)
    fleet = fleet_of(launcher)
    log: list[str] = []
    join = request(tmp_path, {"action": "join", "engines": 2})
    drain = request(tmp_path, {"action": "drain", "engine": 0})
    bad = control_dir(tmp_path) / "zz-bad.json"
    bad.write_text(json.dumps({"action": "drain", "engine": -1}))
    huge = control_dir(tmp_path) / "zz-huge.json"
    huge.write_text(json.dumps({"action": "join", "pad": "x" * MAX_REQUEST_BYTES}))

    async def go() -> int:
        await fleet.start(0)
        n = await Control(tmp_path, fleet, log.append).poll()
        await fleet.membership.joins_done()
        return n

    assert asyncio.run(go()) == 4
    assert sorted(e.index for e in fleet.engines) == [1, 2, 3]
    done = control_dir(tmp_path) / "done"
    assert json.loads((done / join.name).read_text()) == {"ok": True, "joining": [2, 3]}
    assert json.loads((done / drain.name).read_text()) == {"ok": True, "left": 0}
    refused = json.loads((done / bad.name).read_text())
    assert refused["ok"] is False and refused["error"].startswith("drain.engine:")
    assert "larger than 4096 bytes" in json.loads((done / huge.name).read_text())["error"]
    assert not list(control_dir(tmp_path).glob("*.json"))  # each read once
    assert any("refused" in line for line in log)


def test_engines_join_when_the_placement_has_room_for_them(tmp_path: Path) -> None:
    launcher = Launcher(1)
    fleet = fleet_of(launcher)
    log: list[str] = []
    asked: list[int] = []
    room = [0, 2, 0]  # a node that holds two engines comes up before the second poll

    def grow(engines: int) -> int:
        asked.append(engines)
        return room[len(asked) - 1]

    async def go() -> None:
        await fleet.start(0)
        control = Control(tmp_path, fleet, log.append, grow=grow)  # no control folder: fine
        for _ in range(3):
            assert await control.poll() == 0
            await fleet.membership.joins_done()

    asyncio.run(go())
    assert asked == [1, 1, 3]  # the job's engines each time, the joined ones included
    assert [e.index for e in fleet.engines] == [0, 1, 2] and fleet.membership.joined == 2
    assert log == ["the cluster has room for 2 more engine(s): engines [1, 2] join"]


def test_the_last_engine_is_not_drained(tmp_path: Path) -> None:
    fleet = fleet_of(Launcher(1))
    path = request(tmp_path, {"action": "drain", "engine": 0})

    async def go() -> None:
        await fleet.start(0)
        await Control(tmp_path, fleet, lambda line: None).poll()

    asyncio.run(go())
    outcome = json.loads((control_dir(tmp_path) / "done" / path.name).read_text())
    assert outcome == {"ok": False, "error": "engine 0 is the job's last engine"}
    assert [e.index for e in fleet.engines] == [0]


def test_miles_fleet_writes_a_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "join", str(tmp_path), "--engines", "3"]) == 0
    (path,) = control_dir(tmp_path).glob("*.json")
    assert json.loads(path.read_text()) == {"action": "join", "engines": 3}
    assert main(["fleet", "join", str(tmp_path), "--engines", "0"]) != 0
    assert "engines: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["fleet", "drain", str(tmp_path / "none"), "--engine", "1"]) != 0
    assert "no run folder at" in capsys.readouterr().err


def test_the_producer_skips_a_joined_route_until_it_has_slots() -> None:
    from miles_core.runtime.schedules.slots import EngineSlots, RouteSlots

    launcher = Launcher(1)
    fleet = fleet_of(launcher)

    async def go() -> None:
        await fleet.start(0)
        slots = RouteSlots()
        slots.add(fleet.routes[0], EngineSlots(fleet.routes[0].client, 2, 0))
        fleet.membership.join(1)
        await fleet.membership.joins_done()
        await fleet.publish(1)  # the joined engine serves: its route is not down
        assert not fleet.routes[1].down and fleet.routes[1] not in slots
        assert slots.choose(fleet) is slots.all()[0]

    asyncio.run(go())
