"""A third party's plugins, as a third party ships them: two distributions in this test's data
(``data/miles-thirdparty-algo``: the ``rloo`` algorithm in one module;
``data/miles-thirdparty-transport``: the ``disk`` transport, safetensors loaded by each
engine's ``/update_weights_from_disk``), pip-installed into a folder of their own, found
through their entry points, and trained with by ``miles train`` — no file of Miles touched.
CONTRIBUTING.md walks through the same two plugins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_support import DIVERSITY, run_miles, save_tiny_qwen3, train, write_dist

DATA = Path(__file__).resolve().parent / "data"
DISTRIBUTIONS = ("miles-thirdparty-algo", "miles-thirdparty-transport")
#: offline, and into a folder of its own: the shared environment is left as it was
PIP_INSTALL = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both distributions installed with pip into one folder (put on ``PYTHONPATH``), from a
    copy of the test data: the build writes into its source folder, never into the repo."""
    root = tmp_path_factory.mktemp("thirdparty")
    target = root / "site"
    for name in DISTRIBUTIONS:
        source = shutil.copytree(DATA / name, root / "src" / name)
        pip = subprocess.run(
            [*PIP_INSTALL, "--no-build-isolation", "--target", str(target), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert pip.returncode == 0, pip.stderr
    # the reward of the runs below: varied within every group, so each step has a signal
    return write_dist(target, "miles-diversity", "miles_diversity", DIVERSITY, "diversity")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3")


def _config(tmp_path: Path, model: Path, algorithm: object, transport: object) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(8)
        )
    )
    cfg = {
        "run": {"name": "thirdparty", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": algorithm,
        "transport": transport,
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(tmp_path: Path) -> list[dict[str, float]]:
    lines = (tmp_path / "runs" / "thirdparty" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "eval/accuracy" not in row]


def test_third_party_plugins_are_discovered_and_validated(site: Path, tmp_path: Path) -> None:
    out = run_miles("plugins", "--json", pythonpath=site)
    assert out.returncode == 0, out.stderr
    listed = {p["distribution"]: p["registers"] for p in json.loads(out.stdout)}
    assert listed["miles-thirdparty-algo"] == {"algorithm": ["rloo"]}
    assert listed["miles-thirdparty-transport"] == {"transport": ["disk"]}
    # Their options are validated with the run's: a bad one names its field.
    config = _config(tmp_path, tmp_path, {"name": "rloo", "coef": 0}, {"name": "disk", "keep": 0})
    out = run_miles("config", "validate", str(config), pythonpath=site)
    assert out.returncode != 0
    assert "algorithm.coef" in out.stderr and "transport.keep" in out.stderr, out.stderr
    # Not installed, they are not there: a config naming them is refused.
    out = run_miles("config", "validate", str(config))
    assert "no algorithm 'rloo'" in out.stderr and "no transport 'disk'" in out.stderr, out.stderr
    # Each builds an object that meets its kind's contract (miles_core.testing.contracts).
    code = (
        "from miles_core.components import Kind\n"
        "from miles_core.plugins import load_plugins\n"
        "from miles_core.testing.contracts import check_component\n"
        "registry = load_plugins().registry\n"
        "check_component(registry.get(Kind.ALGORITHM, 'rloo'))\n"
        "check_component(registry.get(Kind.TRANSPORT, 'disk')).close()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    checked = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert checked.stdout.strip() == "ok", checked.stderr


@pytest.mark.slow
def test_two_rl_steps_with_the_third_party_algorithm(
    site: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, tiny_qwen3, {"name": "rloo"}, {"name": "colocated"})
    out = train(config, site=site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:  # the algorithm's own metrics, from its loss
        assert s["train/rloo/advantage_abs_mean"] > 0
        assert "train/rloo/reward_mean" in s
        assert s["train/grad_norm"] > 0


@pytest.mark.slow
def test_two_rl_steps_with_the_third_party_transport(
    site: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "weights"
    config = _config(
        tmp_path, tiny_qwen3, {"name": "grpo"}, {"name": "disk", "directory": str(folder)}
    )
    out = train(config, site=site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    # the version each engine reported after loading the transport's folder
    assert [s["sync/disk/engine_version"] for s in steps] == [1.0, 2.0]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    assert all(s["sync/bytes"] > 0 for s in steps)
    # keep: 1 — only the last update stays on disk, whole
    assert sorted(p.name for p in folder.iterdir()) == ["v2"]
    assert (folder / "v2" / "model.safetensors").is_file()
    # the engine served the transport's weights: the trainer's log-probs match the engine's
    assert steps[1]["train/mismatch/abs_max"] < 1e-4, steps[1]["train/mismatch/abs_max"]
