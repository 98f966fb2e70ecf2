"""`miles family list/verify` and the refusal of an unverified family at launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Backend, algorithm and transport records so `miles train` gets past validation; their
# factories are never called (the family check or the model-path check refuses first). The
# engine is the real embedded one: the engine gate of `miles family verify` starts it.
PLACEHOLDERS = """
from miles_core import hookimpl, TrainerBackend, Algorithm, Transport
def build(options):
    return options
@hookimpl
def miles_register_trainer_backends(register):
    register(TrainerBackend(name="b", factory=build))
@hookimpl
def miles_register_algorithms(register):
    register(Algorithm(name="a", factory=build))
@hookimpl
def miles_register_transports(register):
    register(Transport(name="t", factory=build))
"""


def _miles(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "miles_core.cli", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_placeholders.py").write_text(textwrap.dedent(PLACEHOLDERS))
    info = site / "miles_placeholders-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: miles-placeholders\nVersion: 0.0.1\n"
    )
    (info / "entry_points.txt").write_text("[miles]\nplaceholders = miles_placeholders\n")
    return {
        # the placeholders first, then whatever the caller's path holds (a source checkout)
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
        "MILES_CERT_DIR": str(tmp_path / "certs"),
        "MILES_PLUGINS": "miles-placeholders,miles-modelfamilies,miles-engine-embedded",
    }


@pytest.mark.slow
def test_unverified_family_is_refused_until_verified_or_accepted(env, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {{path: m, family: smollm2}}\nbackend: b\nengine: embedded\nalgorithm: a\n"
        f"transport: t\nreward: last_number\ndata: {{name: jsonl, path: {data}}}\n"
    )
    refused = _miles("train", str(cfg), env=env)
    assert refused.returncode == 2, refused.stderr
    assert "model.family 'smollm2' is not verified" in refused.stderr
    assert "miles family verify smollm2" in refused.stderr

    accepted = _miles("train", str(cfg), "--set", "model.accept_unverified_family=true", env=env)
    # past the family check, the run stops at its next check: the model path does not exist
    assert accepted.returncode == 2 and "model.path 'm' does not exist" in accepted.stderr

    listed = json.loads(_miles("family", "list", "--json", env=env).stdout)
    assert {r["name"]: r["status"] for r in listed} == {
        "smollm2": "not_verified",
        "qwen3": "not_verified",
        "qwen3_5": "not_verified",
        "qwen3_thinking_2507": "not_verified",
        "deepseek_v4": "not_verified",
    }
    # Both gates: the engine gate starts the engine that runs on CPU through the registry.
    verify = _miles("family", "verify", "smollm2", env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "PASSED the cpu+engine gate" in verify.stdout and "(embedded engine)" in verify.stdout
    listed = json.loads(_miles("family", "list", "--json", env=env).stdout)
    assert {r["name"]: r["status"] for r in listed}["smollm2"] == "verified"

    after = _miles("train", str(cfg), env=env)
    assert after.returncode == 2 and "model.path 'm' does not exist" in after.stderr


@pytest.mark.slow
def test_verify_failing_template_exits_1_with_a_readable_report(env):
    out = _miles("family", "verify", "qwen3", "--option", "template=original", env=env)
    assert out.returncode == 1
    assert "turn" in out.stdout and "first difference" in out.stdout.lower()
    bad = _miles("family", "verify", "qwen3", "--option", "template=nope", env=env)
    assert bad.returncode == 2 and "option.template" in bad.stderr
