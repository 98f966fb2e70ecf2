"""The command line: version, the full install, and scaffolding plugins that pass their tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from core_support import run_miles

from miles_core import __version__
from miles_core.scaffold import KINDS

REPO = Path(__file__).resolve().parents[1]


def _repo_plugin_distributions() -> dict[str, Path]:
    out = {}
    for pyproject in sorted((REPO / "plugins").rglob("pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())
        if "miles" in meta["project"].get("entry-points", {}):
            out[meta["project"]["name"]] = pyproject.parent
    return out


def test_version():
    out = run_miles("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"miles-core {__version__}"


def test_full_install_lists_every_distribution_of_the_repo():
    dists = _repo_plugin_distributions()
    assert dists, "the repo has no plugin distributions"
    out = run_miles("plugins", "--json")
    assert out.returncode == 0, out.stderr
    listed = {p["distribution"]: p for p in json.loads(out.stdout)}
    for name in dists:
        assert name in listed, f"{name} is not installed or not discovered"
        assert listed[name]["registers"] or listed[name]["hooks"], (
            f"{name} registers nothing and implements no hook"
        )


def test_allow_list_with_one_repo_plugin_loads_only_it():
    name = next(iter(_repo_plugin_distributions()))
    out = run_miles("plugins", "--json", env={"MILES_PLUGINS": name})
    assert {p["distribution"] for p in json.loads(out.stdout)} == {"miles-core", name}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_new_plugin_scaffold_passes_its_contract_test(kind, tmp_path):
    name = f"my_{kind.replace('-', '_')}"
    out = run_miles("new", "plugin", kind, name, "--output", str(tmp_path))
    assert out.returncode == 0, out.stderr
    root = tmp_path / f"miles-{name.replace('_', '-')}"
    assert {p.name for p in root.iterdir()} >= {
        "pyproject.toml",
        "README.md",
        "tests",
        f"miles_{name}",
    }
    env = {**os.environ, "PYTHONPATH": str(root)}
    test = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "1 passed" in test.stdout


def test_scaffolded_plugin_installs_and_is_discovered(tmp_path):
    assert (
        run_miles(
            "new", "plugin", "reward", "contains_answer", "--output", str(tmp_path)
        ).returncode
        == 0
    )
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(tmp_path / "miles-contains-answer"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    out = run_miles(
        "plugins", "--json", pythonpath=target, env={"MILES_PLUGINS": "miles-contains-answer"}
    )
    listed = {p["distribution"]: p for p in json.loads(out.stdout)}
    assert listed["miles-contains-answer"]["registers"] == {"reward_function": ["contains_answer"]}


def test_scaffold_refuses_bad_input(tmp_path):
    out = run_miles("new", "plugin", "reward", "Bad-Name", "--output", str(tmp_path))
    assert out.returncode == 2 and "invalid" in out.stderr
    out = run_miles("new", "plugin", "rewardz", "x", "--output", str(tmp_path))
    assert out.returncode == 2 and "invalid choice" in out.stderr


def _block_after(text: str, marker: str) -> str:
    rest = text[text.index(marker) :]
    start = rest.index("```")
    body = rest[start:].split("\n", 1)[1]
    return body[: body.index("```")]


def test_contributing_tutorial_plugin_installs_and_works(tmp_path):
    """The one-module reward plugin of CONTRIBUTING.md, exactly as written there."""
    doc = (REPO / "CONTRIBUTING.md").read_text()
    src = tmp_path / "miles-short"
    src.mkdir()
    (src / "miles_short.py").write_text(_block_after(doc, "`miles_short.py`:"))
    (src / "pyproject.toml").write_text(_block_after(doc, "`pyproject.toml` (five lines"))
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    env = {"MILES_PLUGINS": "miles-short"}
    out = run_miles(
        "plugins", "--hook", "miles_register_reward_functions", "--json", pythonpath=target, env=env
    )
    listed = {p["distribution"]: p for p in json.loads(out.stdout)}
    assert listed["miles-short"]["registers"] == {"reward_function": ["short"]}
    code = (
        "from miles_core.plugins import load_plugins\n"
        "from miles_core.components import Kind\n"
        "from miles_core.data import Sample\n"
        "reg = load_plugins().registry\n"
        "short = reg.get(Kind.REWARD_FUNCTION, 'short')\n"
        "fn = short.build(short.config(max_chars=5))\n"
        "ok = Sample(prompt_ids=[1], metadata={'response_text': 'tiny'})\n"
        "long = Sample(prompt_ids=[1], metadata={'response_text': 'far too long'})\n"
        "print(fn(ok, {}), fn(long, {}))\n"
    )
    full_env = {**os.environ, "PYTHONPATH": str(target), **env}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60
    )
    assert res.stdout.split() == ["1.0", "0.0"], res.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("reward: {name: short, max_chars: 0}\n")
    bad = run_miles("config", "validate", str(cfg), pythonpath=target, env=env)
    assert bad.returncode == 2
    assert "reward.max_chars: Input should be greater than or equal to 1 (got 0)" in bad.stderr
