"""Fault injection in a 30-step fully asynchronous run (Ray disaggregated placement, two
embedded engines, a tiny Qwen3): an engine server is killed (SIGKILL) three times, once
around a weight update and twice while one of its groups is generating, and the run itself
(the trainer's driver) is killed once after step 17. The run resumes from its step-15
checkpoint with ``miles train --resume`` and completes: every restart is counted, the groups
the dead engines held are in the ledger as engine_failed, the groups the killed run held are
in it as interrupted, the ledger balances at every step and no trained group exceeds the staleness
bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import async_ray_config, train, write_dist

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]

RAY = "{num_cpus: 3, trainer_cpus: 1, object_store_mb: 80, ready_timeout_s: 60}"
STEPS = 30
BOUND = 2

KILLER = """
import asyncio, os, signal, threading
from urllib.parse import urlparse
from miles_core import RewardFunction, RolloutFunction, hookimpl
from miles_core.builtins.rollouts import SingleTurn, SingleTurnOptions

def _server(port):
    # The engine server listening on ``port``: the process holding that listening socket (the
    # server binds a port of its own choosing, so its command line does not name it).
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(cols[9])
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"miles_engine_embedded.server" not in f.read():
                    continue
            links = [os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
        except OSError:
            continue
        if any(link[len("socket:["):-1] in inodes for link in links if link.startswith("socket:[")):
            found.append(int(name))
    assert len(found) == 1, (port, found)
    return found[0]

def _log(line):
    with open(os.environ["KILL_LOG"], "a") as f:
        f.write(line + "\\n")

def _kills():
    try:
        with open(os.environ["KILL_LOG"]) as f:
            return sum(line.startswith("engine") for line in f)
    except FileNotFoundError:
        return 0

_port = []
_trying = []

@hookimpl
def miles_after_train_step(step, groups, metrics):
    # The first kill: an engine dies around the weight update that follows step 3's training
    # (the update pauses both engines and streams to both).
    if step == 3 and _kills() == 0 and _port:
        def kill():
            _log("engine killed at the update of step 3")
            os.kill(_server(_port[0]), signal.SIGKILL)
        threading.Timer(0.05, kill).start()

class KillingRollout(SingleTurn):
    # The first group started from steps 9 and 19 on: its engine is killed while requests are
    # on it, so the groups they belong to are lost with the engine, for certain. (A group
    # starts when an engine and the buffer have room, which is not every step.) The engine is
    # stopped (SIGSTOP) before the group's requests go out, so none can finish before the
    # kill, however fast the machine: they are sent, and wait on it unanswered until it dies.
    # Requests that never reached the engine (waiting at the gate a weight update closed, or
    # for a slot) are not lost: they go to the restarted engine. So the kill waits until
    # requests are on the engine; a group that finds none there (an update paused the
    # engines meanwhile) lets it go on, and a later group tries again.
    async def __call__(self, prompt, *, engine, **kw):
        step = kw.get("step", 0)
        _port[:] = [urlparse(engine.base_url).port]
        done = _kills()
        if _trying or done == 0 or done >= 3 or step < (0, 9, 19)[done]:
            return await super().__call__(prompt, engine=engine, **kw)
        _trying.append(step)  # one try at a time: the groups of a step start together
        try:
            server = _server(urlparse(engine.base_url).port)
            os.kill(server, signal.SIGSTOP)
            task = asyncio.ensure_future(super().__call__(prompt, engine=engine, **kw))
            await asyncio.sleep(0.3)
            if engine.slots.on_engine == 0:
                os.kill(server, signal.SIGCONT)
            else:
                _log(f"engine killed in step {step}")
                os.kill(server, signal.SIGKILL)
        finally:
            _trying.clear()
        return await task

@hookimpl
def miles_register_rollout_functions(register):
    register(RolloutFunction(
        name="killing", factory=KillingRollout, config=SingleTurnOptions,
        requires={"modality": ["text"]},
    ))

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(
        name="diversity",
        factory=lambda options: lambda s, p: (sum(s.response_ids) % 1000) / 1000,
    ))

@hookimpl
def miles_after_weight_sync(step, version, metrics):
    marker = os.environ["KILL_LOG"] + ".trainer"
    if step == 17 and not os.path.exists(marker):
        open(marker, "w").close()
        _log("trainer killed after step 17")
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_engines_killed_three_times_and_the_trainer_once(
    tiny_qwen3: Path,
    tmp_path: Path,
) -> None:
    site = write_dist(tmp_path / "site", "miles-killer", "miles_killer", KILLER, "killer")
    raw = async_ray_config(tmp_path, tiny_qwen3, steps=STEPS, capacity=4, max_staleness=BOUND)
    raw["run"]["name"] = "faults"
    raw["run"]["checkpoint_every"] = 5
    raw["engine"]["num_engines"] = 2
    # one route per engine, no router: the test kills the engine a given group runs on, which
    # it learns from the engine view's base_url (behind a router that is the router's)
    raw["router"] = None
    raw["rollout"]["max_new_tokens"] = 16
    raw["rollout_function"] = "killing"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    kills = tmp_path / "kills.log"
    env = {"MILES_RAY": RAY, "KILL_LOG": str(kills)}

    first = train(config, site=site, env=env, timeout=900)
    assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-5000:]
    lines = kills.read_text().splitlines()
    assert lines[0] == "engine killed at the update of step 3", lines
    assert lines[1].startswith("engine killed in step"), lines
    assert int(lines[1].rsplit(" ", 1)[1]) < 15, lines  # before the checkpoint resumed from
    assert lines[2] == "trainer killed after step 17" and len(lines) == 3, lines
    run = tmp_path / "runs" / "faults"
    assert (run / "checkpoints" / "step_15" / "loop.json").is_file()

    second = train(config, "--resume", site=site, env=env, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-5000:]
    lines = kills.read_text().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("engine killed in step"), lines
    assert "step 16/30" in second.stderr and "step 15/30" not in second.stderr
    assert first.stderr.count("stopped answering: restarting it") == 2
    assert second.stderr.count("stopped answering: restarting it") == 1

    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "eval/accuracy" not in r]
    by_step = {r["step"]: r for r in rows}  # the resumed run's rows replace the killed one's
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for r in rows:
        states = sum(r[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped"))
        assert r["ledger/produced"] == states, r
        reasons = sum(v for k, v in r.items() if k.startswith("ledger/dropped."))
        assert reasons == r["ledger/dropped"], r
        assert r["ledger/trained"] == 2 * r["step"], r
        assert r["staleness/consumed_max"] <= BOUND, r  # never above the bound
        assert r["weight_version"] == r["step"]
    restarts = [by_step[s]["engine/restarts"] for s in range(1, STEPS + 1)]
    assert restarts == sorted(restarts) and restarts[-1] == 3, restarts
    assert restarts[1] == 0  # nothing restarted before the first kill
    last = by_step[STEPS]
    drops = {
        s: {k: v for k, v in r.items() if k.startswith("ledger/dropped.") and v}
        for s, r in by_step.items()
    }
    # the groups whose requests were on an engine killed while generating are dropped as
    # engine_failed: at least one for each of those two kills (the first lies before the
    # step-15 checkpoint the resumed run starts from); the one killed around an update may
    # have had none there
    assert by_step[18]["ledger/dropped.engine_failed"] >= 1, (kills.read_text(), drops)
    assert last["ledger/dropped.engine_failed"] >= 2, (kills.read_text(), drops)
    assert last["ledger/dropped.interrupted"] >= 1  # the killed run's groups in flight
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["trained"] == 2 * STEPS
    assert ledger["in_flight"] == 0 and ledger["buffered"] == 0
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"]
