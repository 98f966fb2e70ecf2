"""The calculator agent job's RL run end to end, fully asynchronous, on CPU:
``examples/agent_calc.yaml`` as ``miles train`` runs it, shortened to 2 steps and 4 held-out
tasks. SmolLM2-135M-Instruct on the embedded engine in a Ray actor, the FSDP2 trainer in
another; each sample is a session driven by the calculator agent through the official
``openai`` client, graded by ``last_number``; every stored turn is checked against the
engine's generations (TITO) and the report's token check passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from miles_env_calculator.report import summarize
from miles_env_calculator.tasks import write

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]

REPO = Path(__file__).resolve().parents[5]


def test_async_calculator_run_with_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("miles_ray")
    pytest.importorskip("miles_sessions")
    pytest.importorskip("openai")
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    data = tmp_path / "data"
    write(data, 64, 4, 0)
    raw = yaml.safe_load((REPO / "examples" / "agent_calc.yaml").read_text())
    raw["run"].update(output_dir=str(tmp_path / "runs"), steps=2)
    raw["model"].update(path=str(smollm2_model_folder()), accept_unverified_family=True)
    raw["data"]["path"] = str(data / "train.jsonl")
    raw["eval"].update(limit=4, data=dict(raw["eval"]["data"], path=str(data / "heldout.jsonl")))
    raw["rollout"].update(group_size=2, groups_per_step=2)
    raw["rollout_function"].update(max_turns=2, max_new_tokens=32)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    out = subprocess.run(
        [sys.executable, "-m", "miles_core.cli", "train", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["steps"] == 2 and line["n_heldout"] == 4
    report = summarize({}, line, 1.0)
    assert report["tito_ok"] and report["tito_mismatches"] == 0 and report["tito_turns"] >= 4
    traces = [json.loads(x) for x in (Path(line["run_dir"]) / "traces.jsonl").open()]
    assert traces
    for trace in traces:
        messages = trace["messages"]
        assert messages[0]["role"] == "user" and "Use the calculate tool" in messages[0]["content"]
        assert messages[-1]["role"] == "assistant"
