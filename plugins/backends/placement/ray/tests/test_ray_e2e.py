"""End to end on a real local Ray cluster: the synchronous loop on a tiny Qwen3 with the FSDP2
trainer in a Ray actor and the embedded engine started from a Ray actor, both placed by one
placement group — colocated (one shared bundle, shared-memory transport) and disaggregated (a
bundle each, gloo broadcast transport)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_core import RewardFunction, hookimpl
from miles_core.config import validate_config
from miles_core.data import Group, Sample
from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
from miles_core.runtime import Run, train

pytestmark = pytest.mark.slow

PROMPT = [9707, 11, 1246, 525, 498, 30, 220, 16]  # a fixed prompt of valid Qwen token ids


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster for the module: 2 logical CPUs, no dashboard, a small store."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=80 * (1 << 20),
        _node_ip_address="127.0.1.1",  # on loopback: its servers need no API key
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary size (the qwen3 family's ids)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("model") / "tiny-qwen3"
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


class Diversity:
    """A reward that differs between samples even for a random model, so every step trains."""

    @hookimpl
    def miles_register_reward_functions(self, register):
        register(
            RewardFunction(
                name="diversity",
                factory=lambda options: lambda s, p: (sum(s.response_ids) % 1000) / 1000,
            )
        )


class Probe:
    """Looks at the run from inside: where the trainer and the engine run once placed, and,
    after every weight sync, the engine's and the trainer's log-probs of one fixed sequence."""

    def __init__(self, ray: Any, *, fail_at_start: bool = False) -> None:
        self.ray = ray
        self.fail_at_start = fail_at_start
        self.run: Run | None = None
        self.placed: dict[str, Any] = {}
        self.synced: list[tuple[int, str, float]] = []

    @hookimpl
    def miles_run_start(self, config, run_dir):
        assert self.run is not None and self.run.parts is not None
        parts = self.run.parts
        # run.json says where every process is
        placed = json.loads((Path(run_dir) / "run.json").read_text())["placement"]
        (rank,) = [p for p in placed["processes"] if p["role"] == "trainer_rank"]
        (engine,) = [p for p in placed["processes"] if p["role"] == "engine"]
        self.placed = {
            "trainer": rank,
            "engine": engine,
            "run_json": placed,
            "server_pid": parts.launcher.pids(0)[1],
            "available": self.ray.available_resources(),
            "bundles": parts.trainer.ranks.placement.layout.bundles,
            "fingerprint": parts.trainer.fingerprint(),
        }
        if not self.run.resume:
            # export_weights consumed here, away from the sender: streamed through Ray
            import torch
            from safetensors.torch import load_file

            saved = load_file(str(Path(config.model.path) / "model.safetensors"))
            streamed = dict(parts.trainer.export_weights())
            assert set(saved) <= set(streamed), set(saved) - set(streamed)
            assert all(torch.equal(streamed[k], v) for k, v in saved.items())
            self.placed["streamed_equal"] = len(saved)
        else:
            self.placed["streamed_equal"] = 1  # the checkpoint's weights, checked by the sync
        if self.fail_at_start:
            raise RuntimeError("the probe fails the run once everything is placed")

    @hookimpl
    def miles_after_weight_sync(self, step, version, metrics):
        run = self.run
        assert run is not None and run.parts is not None and run.fleet is not None
        params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        out = run.io(run.fleet.engines[0].client.generate(PROMPT, params))
        sample = Sample(prompt_ids=list(PROMPT))
        sample.append(list(out.output_ids), logprobs=list(out.logprobs), version=version)
        trainer_lp, _ = run.parts.trainer.compute_logprobs([Group(samples=[sample])])
        gap = max(
            abs(float(trainer_lp[0, i]) - out.logprobs[i]) for i in range(len(out.output_ids))
        )
        self.synced.append((version, out.weight_version, gap))


def _plugins(probe: Probe) -> Plugins:
    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Diversity(), name="diversity", distribution="test", version="0")
    pm.register_plugin(probe, name="probe", distribution="test", version="0")
    return Plugins(pm=pm, registry=collect_registry(pm))


def _raw(tmp_path: Path, model: Path, placement: str) -> dict[str, Any]:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(40)
        )
    )
    transport = "colocated" if placement == "colocated" else "broadcast"
    return {
        "run": {
            "name": placement,
            "output_dir": str(tmp_path / "runs"),
            "steps": 2,
            "placement": placement,
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1},
        "engine": {
            "name": "embedded",
            "max_running_requests": 8,
            "num_threads": 1,
            "launch_in": "ray_actor",
            "ray_num_cpus": 1,
        },
        "algorithm": {"name": "grpo"},
        "transport": {"name": transport, "bucket_size_mb": 4, "timeout_s": 60},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], within_s: float = 20.0) -> list[int]:
    """The pids still alive after waiting up to ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _reapers(server_pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-c" in argv and argv[-2:-1] == [str(server_pid).encode()]:
            out.append(int(entry.name))
    return out


def _run(
    ray: Any,
    tmp_path: Path,
    model: Path,
    placement: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    steps: int = 2,
    resume: bool = False,
) -> tuple[Probe, list[dict[str, Any]]]:
    monkeypatch.setenv("MILES_RAY", "{trainer_cpus: 1, ready_timeout_s: 30}")
    probe = Probe(ray)
    plugins = _plugins(probe)
    raw = _raw(tmp_path, model, placement)
    raw["run"]["steps"] = steps
    run = Run(validate_config(raw, plugins.registry), plugins, resume=resume)
    probe.run = run
    t0 = time.perf_counter()
    train(run)
    print(f"{placement}: {time.perf_counter() - t0:.1f} s")
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / placement / "metrics.jsonl").read_text().splitlines()
    ]
    return probe, rows


def _check_steps(rows: list[dict[str, Any]], synced: list[tuple[int, str, float]]) -> None:
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:
        assert s["train/grad_norm"] > 0
        assert s["sync/bytes"] > 0
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
    # the second step's rollouts were sampled with the weights synced after the first
    assert steps[1]["train/mismatch/abs_max"] < 1e-4, steps[1]["train/mismatch/abs_max"]
    # after every sync the engine serves exactly the trainer's weights
    assert [(v, w) for v, w, _ in synced] == [(1, "1"), (2, "2")]
    for _, _, gap in synced:
        assert gap < 1e-4, synced


def _check_placed_then_released(probe: Probe, ray: Any) -> None:
    # the trainer ran in a Ray actor, not in this process, nor in the engine's actor
    trainer, engine = probe.placed["trainer"], probe.placed["engine"]
    assert trainer["pid"] != os.getpid() and engine["pid"] != os.getpid()
    assert trainer["pid"] != engine["pid"]
    assert (
        trainer["placement_group_id"]
        and engine["placement_group_id"] == (trainer["placement_group_id"])
    )  # one placement group for both
    assert trainer["bundle"] == 0 and trainer["index"] == 0
    # every engine URL is its node's address
    (server,) = probe.placed["run_json"]["servers"]
    assert server["address"] == engine["address"] == ray.util.get_node_ip_address()
    # the trainer's weights streamed through Ray equal the checkpoint it was built from
    assert probe.placed["streamed_equal"] > 0
    assert set(probe.placed["fingerprint"]) >= {"weights", "optimizer"}
    # everything was released: actors, the engine server, its reaper, the placement group
    left = _gone([trainer["pid"], engine["pid"], probe.placed["server_pid"]])
    assert left == [], f"still running after the run: {left}"
    assert _gone(_reapers(probe.placed["server_pid"])) == []
    pg_id = trainer["placement_group_id"]
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    end = time.monotonic() + 20  # the raylet returns a removed group's bundles shortly after
    while any(pg_id in k for k in ray.available_resources()) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(pg_id in k for k in ray.available_resources())


def test_colocated_under_ray(
    ray_cluster: Any, tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe, rows = _run(ray_cluster, tmp_path, tiny_qwen3, "colocated", monkeypatch)
    assert probe.placed["bundles"] == [{"CPU": 2.0}]  # trainer and engine share one bundle
    # both actors hold their CPU in bundle 0: nothing of its 2 CPUs is left free
    pg_id = probe.placed["trainer"]["placement_group_id"]
    assert f"CPU_group_0_{pg_id}" not in probe.placed["available"]
    _check_steps(rows, probe.synced)
    _check_placed_then_released(probe, ray_cluster)
    # the trainer actor's colocated buckets (torch's shared memory) left with it
    pid = probe.placed["trainer"]["pid"]
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")] == []


def test_disaggregated_under_ray_and_resumed(
    ray_cluster: Any, tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one step, checkpointed at the end by the trainer's actor; then a new placement resumes it
    first, _ = _run(ray_cluster, tmp_path, tiny_qwen3, "disaggregated", monkeypatch, steps=1)
    second, rows = _run(
        ray_cluster, tmp_path, tiny_qwen3, "disaggregated", monkeypatch, steps=2, resume=True
    )
    for probe in (first, second):
        assert probe.placed["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]  # separate pools
        # bundle 0 (the trainer's) and bundle 1 (the engine's) are each fully taken
        pg_id = probe.placed["trainer"]["placement_group_id"]
        available = probe.placed["available"]
        assert f"CPU_group_0_{pg_id}" not in available
        assert f"CPU_group_1_{pg_id}" not in available
        _check_placed_then_released(probe, ray_cluster)
    assert first.placed["trainer"]["pid"] != second.placed["trainer"]["pid"]
    # the resumed engine got the checkpoint's weights before step 2's rollouts
    _check_steps(rows, first.synced + second.synced)


def test_a_run_that_fails_once_placed_releases_everything(
    ray_cluster: Any, tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_RAY", "{trainer_cpus: 1, ready_timeout_s: 30}")
    probe = Probe(ray_cluster, fail_at_start=True)
    plugins = _plugins(probe)
    config = validate_config(_raw(tmp_path, tiny_qwen3, "colocated"), plugins.registry)
    probe.run = Run(config, plugins)
    with pytest.raises(RuntimeError, match="the probe fails the run"):
        train(probe.run)
    _check_placed_then_released(probe, ray_cluster)


def test_a_placement_the_cluster_cannot_hold_is_refused_and_released(
    ray_cluster: Any, tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles_core.errors import MilesUserError

    probe = Probe(ray_cluster)
    plugins = _plugins(probe)
    raw = _raw(tmp_path, tiny_qwen3, "disaggregated")
    raw["run"]["name"] = "too-big"
    # a bundle no node can hold: refused before anything is reserved, naming the nodes
    monkeypatch.setenv("MILES_RAY", "{trainer_cpus: 3, ready_timeout_s: 2}")
    with pytest.raises(MilesUserError) as err:
        train(Run(validate_config(raw, plugins.registry), plugins))
    text = str(err.value)
    assert "bundle 0 {'CPU': 3.0} fits no node" in text and "CPU: 2" in text, text
    assert "MILES_RAY.trainer_cpus" in text
    # each bundle fits a node, all of them do not: refused once the reservation times out
    monkeypatch.setenv("MILES_RAY", "{trainer_cpus: 2, ready_timeout_s: 2}")
    with pytest.raises(MilesUserError) as err:
        train(Run(validate_config(raw, plugins.registry), plugins))
    text = str(err.value)
    assert "could not reserve the bundles [{'CPU': 2.0}, {'CPU': 1.0}]" in text
    assert "'CPU': 2.0" in text and "MILES_RAY.trainer_cpus" in text  # what the cluster has
    mine = [
        pg
        for pg in ray_cluster.util.placement_group_table().values()
        if pg["name"].startswith("miles-too-big-")
    ]
    assert len(mine) == 1 and mine[0]["state"] == "REMOVED"
    assert probe.placed == {}  # the run never started


def test_an_engine_actor_that_dies_takes_its_server_along(
    ray_cluster: Any, tiny_qwen3: Path
) -> None:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1, num_threads=1))
    try:
        launcher.launch(str(tiny_qwen3), index=0)
        actor_pid, server_pid = launcher.pids(0)
        assert _alive(server_pid) and _reapers(server_pid)
        # killed without being asked to stop its server, as when its placement group goes
        ray_cluster.kill(launcher.actors[0])
        assert _gone([actor_pid, server_pid]) == [], "the server outlived its actor"
        assert _gone(_reapers(server_pid)) == []
    finally:
        launcher.shutdown()


def test_rank_actors_name_a_rank_that_fails_or_dies(ray_cluster: Any, tiny_qwen3: Path) -> None:
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_ray.ranks import RankError, RayRanks
    from miles_trainer_common.ranks import RankServer, rank_spec

    spec = rank_spec(
        FSDP2Options(world_size=2, cpu_threads=1, timeout_s=60),
        worker="miles_backend_fsdp2.worker:RankWorker",
        name="fsdp2",
    )
    ranks = RayRanks(spec, RankServer, lambda r: {"num_cpus": 0.5})
    try:
        # each rank is its own actor, on this node's address, in one group over TCP
        assert len({w["pid"] for w in ranks.where}) == 2
        assert {w["address"] for w in ranks.where} == {ray_cluster.util.get_node_ip_address()}
        ranks.call("setup", str(tiny_qwen3))
        weights = dict(ranks.export())  # rank 0's whole tensors, every rank taking part
        assert weights and all(t.numel() for t in weights.values())
        with pytest.raises(RankError, match=r"fsdp2 rank [01] failed in _private:\n"):
            ranks.call("_private")  # a rank's private method is not reachable
        assert ranks.closed  # a failed call stops every rank
    finally:
        ranks.close()
    ranks = RayRanks(spec, RankServer, lambda r: {"num_cpus": 0.5})
    try:
        ray_cluster.kill(ranks.actors[1])
        with pytest.raises(RankError, match=r"fsdp2 rank 1 died in setup"):
            ranks.call("setup", str(tiny_qwen3))
    finally:
        ranks.close()
