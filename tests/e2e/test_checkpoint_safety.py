"""Checkpoints and the run folder against a careless user and an attacker: nothing runs from a
checkpoint, a damaged checkpoint is found by its manifest and skipped, a failed resume leaves the
previous run's record as it was, and a run writes and moves only its own folder.

One real ``miles train`` (FSDP2 trainer, embedded engine, GRPO, qwen3 family, tiny model) saves
two checkpoints; each resume case works on its own copy of that run folder.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from core_support import run_miles, save_tiny_qwen3, train, write_prompts

from miles_core.config import (
    MAX_YAML_NODES,
    ConfigError,
    YamlExpansionError,
    load_yaml,
    read_config,
)
from miles_core.runtime.checkpointer import Checkpointer, CheckpointError, verify

NAME = "job"
RECORD = ("run.json", "ledger.json", "metrics.jsonl")


def _config(
    tmp_path: Path, model: Path, output_dir: Path, name: str = NAME, steps: int = 2
) -> dict[str, object]:
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    return {
        "run": {
            "name": name,
            "output_dir": str(output_dir),
            "steps": steps,
            "checkpoint_every": 1,
            "seed": 7,
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 1},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "last_number",
        "data": {"name": "jsonl", "path": str(data)},
        "rollout": {"group_size": 2, "groups_per_step": 1, "max_new_tokens": 4},
    }


def _write(path: Path, cfg: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(model, run folder)``: a finished two-step run with checkpoints at steps 1 and 2."""
    base = tmp_path_factory.mktemp("trained")
    model = save_tiny_qwen3(base / "tiny-qwen3")
    cfg = _write(base / "run.yaml", _config(base, model, base / "runs"))
    done = train(cfg)
    assert done.returncode == 0, done.stderr[-5000:]
    run = base / "runs" / NAME
    assert [p.name for p in Checkpointer(run, 1).saved()] == ["step_1", "step_2"]
    return model, run


def _copy(trained: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the trained run under ``tmp_path/runs`` and its config (``--resume``)."""
    model, run = trained
    copy = tmp_path / "runs" / NAME
    shutil.copytree(run, copy)
    return copy, _write(tmp_path / "run.yaml", _config(tmp_path, model, tmp_path / "runs"))


def _record(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in RECORD}


def _rehash(step: Path) -> None:
    """Rewrite ``step``'s manifest to match its files, as someone who wrote the whole folder
    would: the checksums then pass and only the loader stands between the file and the run."""
    files = {
        p.relative_to(step).as_posix(): {
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in step.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    (step / "manifest.json").write_text(json.dumps({"files": files}))


class _Payload:
    """Pickles to a call of ``exec``: loading it with plain pickle writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _poison(file: Path, marker: Path) -> None:
    """Make ``file`` carry a payload that writes ``marker`` when unpickled, keeping the rest."""
    if file.name == ".metadata":  # DCP's own pickle
        file.write_bytes(pickle.dumps(_Payload(marker)))
        return
    content = torch.load(file, weights_only=True)  # written by this version: plain values
    content["extra" if file.name == "trainer.pt" else "python"] = {"payload": _Payload(marker)}
    torch.save(content, file)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer.pt", "rng_rank0.pt", "sharded/.metadata"])
def test_a_checkpoint_that_would_run_code_is_refused_and_the_record_kept(
    trained: tuple[Path, Path], tmp_path: Path, name: str
) -> None:
    run, cfg = _copy(trained, tmp_path)
    marker = tmp_path / "marker"
    step = run / "checkpoints" / "step_2"
    poisoned = step / "trainer" / name
    _poison(poisoned, marker)
    _rehash(step)
    verify(step)  # the manifest passes: the loader must refuse the file
    before = _record(run)

    resumed = train(cfg, "--resume", timeout=300)

    assert resumed.returncode != 0
    assert not marker.exists(), "loading the checkpoint ran its code"
    assert str(poisoned) in resumed.stderr, resumed.stderr[-3000:]
    assert "is refused" in resumed.stderr and "Traceback" not in resumed.stderr, resumed.stderr
    assert _record(run) == before  # run.json, ledger.json and metrics as the last run left them


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    run, cfg = _copy(trained, tmp_path)
    ledger = json.loads((run / "ledger.json").read_text())
    shard = run / "checkpoints" / "step_2" / "trainer" / "sharded" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    assert len(data) > 3 * 65536
    at = len(data) // 2
    data[at : at + 65536] = bytes(b ^ 0xFF for b in data[at : at + 65536])  # same size
    shard.write_bytes(bytes(data))
    (run / "checkpoints" / "step_final").mkdir()  # not a checkpoint: ignored

    resumed = train(cfg, "--resume", timeout=400)

    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "skipping checkpoint step_2" in resumed.stderr
    assert f"{shard} does not match its sha256" in resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 2
    # Step 2 trained again from step 1: the counts are those of the uninterrupted run.
    assert json.loads((run / "ledger.json").read_text()) == ledger
    verify(run / "checkpoints" / "step_2")  # saved again, whole


@pytest.mark.slow
def test_no_verified_checkpoint_is_a_clear_error_that_writes_nothing(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    run, cfg = _copy(trained, tmp_path)
    truncated = run / "checkpoints" / "step_2" / "trainer" / "rng_rank0.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    missing = run / "checkpoints" / "step_1" / "trainer" / "trainer.pt"
    missing.unlink()
    before = _record(run)

    resumed = train(cfg, "--resume", timeout=300)

    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert "verifies" in resumed.stderr
    assert f"{truncated} has 100 bytes" in resumed.stderr
    assert f"{missing} is missing" in resumed.stderr
    assert _record(run) == before


def test_a_stray_folder_under_checkpoints_is_not_a_checkpoint(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, 1)
    for name in ("step_final", "step_2", "step_", "step_1.bak", "step_10"):
        (ckpt.root / name).mkdir(parents=True)
        (ckpt.root / name / "loop.json").write_text("{}")
    assert [p.name for p in ckpt.saved()] == ["step_2", "step_10"]
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ckpt.latest_verified(lambda line: None)


def test_a_new_run_refuses_a_folder_that_is_not_an_earlier_run(tmp_path: Path) -> None:
    model = save_tiny_qwen3(tmp_path / "tiny-qwen3")
    output = tmp_path / "out"
    theirs = output / NAME
    theirs.mkdir(parents=True)
    (theirs / "thesis.tex").write_text("years of work")
    other = output / "other"  # an earlier run, but of another name
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"config": {"run": {"name": "elsewhere"}}}))
    for name in (NAME, "other"):
        cfg = _write(tmp_path / "run.yaml", _config(tmp_path, model, output, name=name))
        res = train(cfg, timeout=300)
        assert res.returncode == 2, res.stderr[-3000:]
        assert f"the run folder {output / name} is not empty" in res.stderr
    assert sorted(p.name for p in output.iterdir()) == [NAME, "other"]  # nothing moved
    assert sorted(p.name for p in theirs.iterdir()) == ["thesis.tex"]
    assert sorted(p.name for p in other.iterdir()) == ["run.json"]


@pytest.mark.parametrize("name", ["", "../x", "/abs", "a/b", "..", "a\\b"])
def test_run_name_must_be_one_folder_name(tmp_path: Path, name: str) -> None:
    cfg = _config(tmp_path, tmp_path / "model", tmp_path / "runs")
    good = run_miles("config", "validate", str(_write(tmp_path / "good.yaml", cfg)))
    assert good.returncode == 0, good.stderr
    cfg["run"]["name"] = name  # type: ignore[index]
    bad = run_miles("config", "validate", str(_write(tmp_path / "bad.yaml", cfg)))
    assert bad.returncode == 2
    assert "run.name" in bad.stderr and "one folder name under run.output_dir" in bad.stderr
    assert not (tmp_path / "x").exists() and not Path("/abs").exists()


def _bomb(levels: int) -> str:
    """A YAML "billion laughs": each level an alias list of ten of the level before."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(YamlExpansionError, match=str(MAX_YAML_NODES)):
        load_yaml(_bomb(9))  # a billion values once expanded
    with pytest.raises(YamlExpansionError, match="refers to the node that contains it"):
        load_yaml("a: &a [1, *a]")
    assert time.monotonic() - t0 < 1.0
    # Anchors used a few times, merge keys included, still read as before.
    assert load_yaml("a: &x {b: 1}\nc: *x\nd: {<<: *x, e: 2}") == {
        "a": {"b": 1},
        "c": {"b": 1},
        "d": {"b": 1, "e": 2},
    }

    cfg = _config(tmp_path, tmp_path / "model", tmp_path / "runs")
    path = _write(tmp_path / "bomb.yaml", cfg)
    # Inside a free-form field: a million values (harmless to build, well past the bound).
    nested = "".join(f"      {line}\n" for line in _bomb(6).splitlines())
    path.write_text(path.read_text() + "plugins:\n  options:\n    free:\n" + nested)
    with pytest.raises(ConfigError, match="aliases"):
        read_config(path)
    res = run_miles("config", "validate", str(path), timeout=60)
    assert res.returncode == 2
    assert str(path) in res.stderr and "aliases" in res.stderr, res.stderr
    # the same through --set
    res = run_miles(
        "config",
        "validate",
        str(_write(tmp_path / "ok.yaml", cfg)),
        "--set",
        "plugins.options.free=" + _bomb(6).replace("\n", ", ").join("{}"),
        timeout=60,
    )
    assert res.returncode == 2 and "--set" in res.stderr and "aliases" in res.stderr, res.stderr
