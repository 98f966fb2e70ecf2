"""Agentic RL end to end, fully asynchronous, on CPU: ``examples/agentic_terminal.yaml`` as
``miles train`` runs it, shortened to 2 steps. SmolLM2-135M-Instruct (the real model) on the
embedded engine in a Ray actor, the FSDP2 trainer in another, broadcast weight sync; each
sample is a session on the session server, driven by the terminal agent through the official
``openai`` client, its shell calls run in the sandbox and graded by the task's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from terminal_helpers import sandbox_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]

REPO = Path(__file__).resolve().parents[5]

# Records what each step trains on: per sample, the session's transcript and the grade.
RECORDER = """
import json, os
from miles_core import hookimpl

@hookimpl
def miles_before_train_step(step, groups):
    with open(os.environ["TRAINED_LOG"], "a") as f:
        for g in groups:
            for s in g.samples:
                f.write(json.dumps({
                    "step": step,
                    "messages": s.metadata.get("messages"),
                    "terminal": s.metadata.get("terminal"),
                    "reward": s.reward,
                    "prompt_tokens": len(s.prompt_ids),
                    "response_tokens": len(s.response_ids),
                    "versions": sorted(set(s.versions)),
                }) + "\\n")
"""


def test_async_agentic_run_with_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("miles_ray")
    pytest.importorskip("miles_sessions")
    pytest.importorskip("openai")
    sandbox_or_skip().close()
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    model = smollm2_model_folder()
    raw = yaml.safe_load((REPO / "examples" / "agentic_terminal.yaml").read_text())
    raw["run"].update(output_dir=str(tmp_path / "runs"), steps=2, checkpoint_every=0)
    raw["model"]["path"] = str(model)
    # the family's gates are the families plugin's tests; this run is about the agent loop
    raw["model"]["accept_unverified_family"] = True
    raw["rollout_function"].update(max_turns=2, max_new_tokens=48)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_recorder.py").write_text(RECORDER)
    info = site / "miles_recorder-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-recorder\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[miles]\nrecorder = miles_recorder\n")
    trained = tmp_path / "trained.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env.update(PYTHONPATH=str(site), TRAINED_LOG=str(trained))
    out = subprocess.run(
        [sys.executable, "-m", "miles_core.cli", "train", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    run = tmp_path / "runs" / raw["run"]["name"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["ledger/trained"] == 2 * r["step"]
        assert r["staleness/consumed_max"] <= 2
        assert r["sync/bytes"] > 0  # the weights went to the engine after each step
        assert r["trainer/tokens_per_s"] > 0
    # every trained sample is an agent session: the task as the first user message, at
    # least one assistant reply, the tokens the session server kept, graded by the task's
    # tests (the grade report of a replay of its shell calls)
    samples = [json.loads(line) for line in trained.read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2  # steps x groups x group size
    for s in samples:
        roles = [m["role"] for m in s["messages"]]
        assert roles[0] == "user" and "assistant" in roles, roles
        assert s["response_tokens"] > 0 and s["prompt_tokens"] > 0
        assert s["terminal"] is not None and s["reward"] is not None
        assert max(s["versions"]) <= s["step"] - 1  # generated with weights the trainer had
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["trained"] == 4
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"]
