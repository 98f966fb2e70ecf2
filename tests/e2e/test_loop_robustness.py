"""Bad input to ``miles train``: a missing model, a data file with malformed rows or none that
are usable, a reward function that raises. Real runs of the command line on a tiny model with
the real plugins (FSDP2, embedded engine, colocated transport, GRPO, qwen3 family)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from core_support import save_tiny_qwen3, train, write_dist

# Raises for every sample of the prompts whose answer is a multiple of 6 (prompts 0, 3, 6...),
# so which groups fail is known in advance; the others get a reward that varies per sample.
FLAKY = """
from miles_core import RewardFunction, hookimpl

def build(options):
    def reward(sample, prompt):
        if int(prompt["answer"]) % 6 == 0:
            raise KeyError("no grader for this answer")
        return (sum(sample.response_ids) % 1000) / 1000
    return reward

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="flaky", factory=build))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary size (the qwen3 family's ids)."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An installed distribution providing the ``flaky`` reward."""
    return write_dist(tmp_path / "site", "miles-flaky", "miles_flaky", FLAKY, "flaky")


def _config(tmp_path: Path, model: Path, data: Path) -> Path:
    cfg = {
        "run": {"name": "robust", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 4},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "flaky",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _prompts(path: Path, bad_at: dict[int, str]) -> Path:
    """Prompts 0..29 with malformed lines inserted at the given (1-based) line numbers."""
    lines = [json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) for i in range(30)]
    for lineno, text in sorted(bad_at.items()):
        lines.insert(lineno - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_missing_model_path_exits_2_before_any_work(tmp_path, site):
    data = _prompts(tmp_path / "prompts.jsonl", {})
    out = train(_config(tmp_path, tmp_path / "no-such-model", data), site=site)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "miles: error: model.path" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made


def test_a_data_file_without_a_usable_row_exits_2(tmp_path, site):
    model = tmp_path / "model"
    model.mkdir()  # refused at the data source, before the model is read
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "no prompt"}\nnot json\n')
    out = train(_config(tmp_path, model, data), site=site)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"miles: error: data file {str(data)!r} has no usable rows" in out.stderr
    assert "the first at line 1" in out.stderr and "Traceback" not in out.stderr


def test_a_receiver_count_in_the_transport_options_is_refused(tmp_path, site):
    model = tmp_path / "model"
    model.mkdir()
    data = _prompts(tmp_path / "prompts.jsonl", {})
    config = _config(tmp_path, model, data)
    cfg = yaml.safe_load(config.read_text())
    # the engines an update reaches come with each send: no option counts them
    cfg["transport"]["num_receivers"] = 2
    config.write_text(yaml.safe_dump(cfg))
    out = train(config, site=site)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "num_receivers" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_bad_rows_and_a_raising_reward_are_counted_and_the_run_goes_on(tiny_model, site, tmp_path):
    data = _prompts(tmp_path / "prompts.jsonl", {2: "{broken", 6: '["a list"]'})
    out = train(_config(tmp_path, tiny_model, data), "--progress", "on", site=site)
    assert out.returncode == 0, out.stderr[-5000:]
    assert (
        f"miles: warning: data file {str(data)!r}: skipped 2 malformed rows (first at line 2)"
        in out.stderr
    )
    rows = [
        json.loads(x)
        for x in (tmp_path / "runs" / "robust" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    # Step 1 tries prompts 0 (its reward raises: dropped) and 1, then 2; step 2: 3 (dropped),
    # 4 and 5. A third of the samples seen failed their reward.
    assert [r["data/skipped_rows"] for r in rows] == [2.0, 2.0]
    assert [r["reward/failure_rate"] for r in rows] == [2 / 6, 4 / 12]
    assert [r["ledger/dropped"] for r in rows] == [1.0, 2.0]
    assert [r["ledger/trained"] for r in rows] == [2.0, 4.0]
    assert [r["rollout/groups_tried"] for r in rows] == [3.0, 3.0]
    assert all(r["reward/std"] > 0 for r in rows)  # kept groups had real rewards

    # stdout's last line is the JSON summary, with the counts; the bar (on stderr) split none
    # of the per-step lines
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["steps"] == 2 and final["skipped_rows"] == 2
    assert final["reward_failure_rate"] == pytest.approx(1 / 3)
    assert "train:" in out.stderr  # the tqdm bar was drawn
    shown = [line.split("\r")[-1] for line in out.stderr.split("\n")]
    step_line = re.compile(
        r"^step (\d)/2 \| reward \d\.\d{3} \| \d+\.\d\d samples/s \| \d+\.\d tokens/s \| "
        r"rollout [\d.]+s train [\d.]+s sync [\d.]+s \| eta \d+:\d\d:\d\d$"
    )
    assert [m.group(1) for line in shown if (m := step_line.match(line))] == ["1", "2"]
