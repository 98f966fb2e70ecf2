"""The ``wandb`` and ``mlflow`` metric sinks: registered through the ``miles`` entry point, pass
the core's contract check, import nothing heavy until opened; and one real two-step
``miles train`` run with both sinks and a sink that raises, which shows at once that W&B's
offline files and MLflow's local store hold every step's metrics and the run's config, and that
a failing sink is logged once, counted in ``sinks/failures`` and does not stop the run."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import DIVERSITY, save_tiny_qwen3, train, write_dist
from miles_sinks.plugin import MlflowSinkOptions, WandbSinkOptions
from pydantic import ValidationError

from miles_core import Kind
from miles_core.plugins import load_plugins
from miles_core.testing.contracts import check_component


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B offline (no network), silent, writing nothing outside the test's folder."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }


BROKEN_SINK = """
from miles_core import hookimpl
from miles_core.components import MetricSink

class Broken:
    def __init__(self, options):
        pass
    def open(self, run_dir):
        pass
    def write(self, step, metrics):
        raise OSError("tracking server unreachable")
    def close(self):
        pass

@hookimpl
def miles_register_metric_sinks(register):
    register(MetricSink(name="broken", factory=Broken))
"""


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file: W&B's transaction log (a 7-byte header, then
    LevelDB-log framing: 32 KiB blocks of chunks, each ``crc32 | length | type`` then the
    bytes; a record is one FULL chunk or FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_registered_and_pass_the_contract_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    registry = load_plugins(allow=["sinks"]).registry
    assert registry.owner(Kind.METRIC_SINK, "wandb").distribution == "miles-sinks"
    check_component(registry.get(Kind.METRIC_SINK, "mlflow"))
    import wandb

    try:
        check_component(registry.get(Kind.METRIC_SINK, "wandb"))
    finally:
        wandb.teardown()  # stops the W&B service process this test started


def test_nothing_heavy_is_imported_until_a_sink_opens() -> None:
    code = (
        "import sys; from miles_core.plugins import load_plugins; "
        "load_plugins(allow=['sinks']); "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "model,bad",
    [(WandbSinkOptions, {"mode": "cloud"}), (MlflowSinkOptions, {"tracking": "x"})],
    ids=["wandb-mode", "mlflow-extra"],
)
def test_bad_options_are_refused(model: type, bad: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        model(**bad)


def test_wandb_defaults_to_offline() -> None:
    assert WandbSinkOptions().mode == "offline"


def _config(tmp_path: Path, model: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(8)
        )
    )
    cfg = {
        "run": {"name": "sinks", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 4},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 2},
        "metrics": {
            "sinks": [
                "jsonl",
                "broken",
                {"name": "wandb", "project": "miles-test", "tags": ["ci"]},
                {"name": "mlflow", "experiment": "miles-test"},
            ]
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_a_two_step_run_reaches_wandb_and_mlflow_and_survives_a_failing_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = save_tiny_qwen3(tmp_path / "tiny-qwen3")
    site = write_dist(tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY)
    write_dist(site, "miles-broken-sink", "miles_broken_sink", BROKEN_SINK, "broken_sink")
    out = train(_config(tmp_path, model), site=site, env=_wandb_env(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    json.loads(out.stdout.strip().splitlines()[-1])  # stdout's last line is still the summary
    run = tmp_path / "runs" / "sinks"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [s["step"] for s in steps] == [1, 2]

    # The failing sink: logged once, naming it and its error; counted; the others go on.
    failures = [line for line in out.stderr.splitlines() if "metric sink 'broken'" in line]
    assert len(failures) == 1, out.stderr[-3000:]
    assert not [line for line in out.stderr.splitlines() if "metric sink 'wandb'" in line]
    assert not [line for line in out.stderr.splitlines() if "metric sink 'mlflow'" in line]
    assert "tracking server unreachable" in failures[0] and "write" in failures[0]
    assert rows[0].get("sinks/failures") is None  # the first emit is the one that failed
    assert all(r["sinks/failures"] == 1.0 for r in rows[1:])

    # W&B offline: the run's .wandb file holds every step's metrics at its step, and the config.
    (wandb_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    run_record = None
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = history.setdefault(record.history.step.num, {})
            # this version writes a key as a one-element nested_key, older ones as key
            row.update(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "run":
            run_record = record.run
    for s in steps:
        logged = history[s["step"]]
        for key in ("reward/mean", "train/grad_norm", "weight_version"):
            assert logged[key] == pytest.approx(s[key]), key
    assert history[2]["eval/accuracy"] == pytest.approx(rows[-1]["eval/accuracy"])
    assert run_record is not None and run_record.display_name == "sinks"
    assert run_record.project == "miles-test" and list(run_record.tags) == ["ci"]
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["run"]["steps"] == 2 and config["backend"]["name"] == "fsdp2"

    # MLflow: the local file store in the run folder, read back with MLflow's own client.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("miles-test")
    (ml_run,) = client.search_runs([experiment.experiment_id])
    assert ml_run.info.run_name == "sinks" and ml_run.info.status == "FINISHED"
    assert ml_run.data.params["run.steps"] == "2"
    assert ml_run.data.params["backend.name"] == "fsdp2"
    # a file store names metrics with "." for "/" (a key may not be another's folder)
    grad = client.get_metric_history(ml_run.info.run_id, "train.grad_norm")
    assert [(m.step, m.value) for m in grad] == [
        (s["step"], pytest.approx(s["train/grad_norm"])) for s in steps
    ]
    clip = client.get_metric_history(ml_run.info.run_id, "train.clip_fraction.low")
    assert [m.step for m in clip] == [1, 2]
    counted = client.get_metric_history(ml_run.info.run_id, "sinks.failures")
    assert counted and all(m.value == 1.0 for m in counted)


class _FailsToOpen:
    """A sink whose ``open`` raises; records what else the run called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, run_dir: str) -> None:
        raise ConnectionError("no route to the tracking server")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append("write")

    def close(self) -> None:
        self.calls.append("close")


def test_a_sink_failing_to_open_is_disabled_and_counted_but_jsonl_stays_fatal(
    tmp_path: Path,
) -> None:
    from miles_core.builtins.metric_sinks import JsonlSink, JsonlSinkOptions
    from miles_core.runtime.reporter import GuardedSinks

    lines: list[str] = []
    broken = _FailsToOpen()
    jsonl = JsonlSink(JsonlSinkOptions())
    sinks = GuardedSinks([jsonl, broken], ["jsonl", "remote"], [True, False], lines.append)
    sinks.open(str(tmp_path))
    for step in (1, 2):
        sinks.write(step, sinks.with_failures({"reward/mean": 0.5}))
    sinks.close()
    assert broken.calls == [] and len(lines) == 1
    assert "'remote' failed in open: ConnectionError: no route" in lines[0]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["sinks/failures"] for r in rows] == [1.0, 1.0]

    # The run's own record (its record says essential): a jsonl sink that cannot write stops
    # the run.
    (tmp_path / "file").write_text("")
    assert load_plugins(allow=["sinks"]).registry.get(Kind.METRIC_SINK, "jsonl").essential
    fatal = GuardedSinks([JsonlSink(JsonlSinkOptions())], ["jsonl"], [True], lines.append)
    with pytest.raises(OSError):
        fatal.open(str(tmp_path / "file"))
