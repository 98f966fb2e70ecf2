"""``miles train`` with the diffusion modality: the real loop, engine process, transports,
buffer, ledger, checkpoints and metrics on a tiny random UNet; kill -9 and ``--resume``; the
input a run refuses at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from miles_diffusion.testing import write_tiny_model

REPO = Path(__file__).resolve().parents[3]

#: a test reward: brightness, but NaN for prompts of class 3 (counted, never trained on)
NAN_REWARD = """
import math
from miles_core import RewardFunction, hookimpl

def build(options):
    def reward(sample, prompt):
        if int(prompt["label"]) == 3:
            return math.nan
        return float(sample.metadata["image"].mean())
    return reward

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="nan_on_three", factory=build))
"""

TIMING_SUFFIXES = ("_s", "per_s", "seconds", "_fraction")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-unet"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installed distribution with the NaN reward."""
    site = tmp_path_factory.mktemp("site")
    (site / "nan_reward.py").write_text(textwrap.dedent(NAN_REWARD))
    info = site / "miles_nan_reward-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-nan-reward\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[miles]\nnan_reward = nan_reward\n")
    return site


def _config(tmp: Path, model: Path, name: str, **over: Any) -> Path:
    cfg: dict[str, Any] = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "steps": 2, "seed": 3,
                "checkpoint_every": 1},
        "model": {"path": str(model)},
        "modality": {"name": "diffusion", "sample_size": 8, "channels": 1, "num_classes": 4,
                     "num_inference_steps": 4},
        "backend": {"name": "diffusion", "lr": 1e-3, "num_threads": 1},
        "engine": {"name": "diffusion", "num_threads": 1},
        "algorithm": {"name": "diffusion_grpo"},
        "transport": {"name": "colocated"},
        "reward": "image_brightness",
        "data": {"name": "digit_prompts", "size": 64, "seed": 1, "classes": [0, 1, 2, 3]},
        "eval": {"data": {"name": "digit_prompts", "size": 4, "seed": 99,
                          "classes": [0, 1, 2, 3]}, "limit": 4},
        "rollout": {"group_size": 3, "groups_per_step": 2},
        "metrics": {"sinks": ["jsonl"]},
    }  # fmt: skip
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            cfg.setdefault(section, {})[field] = value
        else:
            cfg[section] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(site: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env


def _miles(*args: str, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_core.cli", *args],
        capture_output=True,
        text=True,
        env=_env(site),
        cwd=REPO,
        timeout=600,
    )


def _rows(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def _untimed(row: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in row.items()
        if not (k == "time" or k.startswith("time/") or k.endswith(TIMING_SUFFIXES))
    }


def _check_run(run: Path, steps: int, mismatch: float = 1e-5) -> dict[int, dict[str, float]]:
    rows = _rows(run)
    assert sorted(rows) == list(range(1, steps + 1))
    for row in rows.values():
        # the trainer's recomputed step log-probs are the engine's (fp32) on every image drawn
        # with the weights being trained (all of them in a synchronous run)
        if row["train/mismatch/on_policy_images"] > 0:
            assert row["train/mismatch/abs_max"] <= mismatch
        assert row["train/images"] == 6.0
    assert rows[1]["train/mismatch/on_policy_images"] == 6.0  # the first step is on-policy
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["in_flight"] == 0 and ledger["trained"] == 2 * steps
    states = ledger["in_flight"] + ledger["buffered"] + ledger["trained"] + ledger["dropped"]
    assert states == ledger["produced"]
    for step in range(1, steps + 1):  # a grid of the step's samples
        assert (run / "samples" / f"step_{step:05d}.png").stat().st_size > 0
    assert (run / "plot.png").is_file()
    assert (run / "checkpoints" / f"step_{steps}" / "trainer" / "unet").is_dir()
    return rows


def test_sync_run_trains_two_steps_with_held_out_evaluation(
    model_dir: Path, tmp_path: Path
) -> None:
    out = _miles("train", str(_config(tmp_path, model_dir, "sync")))
    assert out.returncode == 0, out.stderr[-5000:]
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["steps"] == 2
    rows = _check_run(tmp_path / "runs" / "sync", 2)
    assert all(r["train/mismatch/on_policy_images"] == 6.0 for r in rows.values())
    assert rows[2]["weight_version"] == 2.0
    evals = [
        json.loads(x)
        for x in (tmp_path / "runs" / "sync" / "metrics.jsonl").read_text().splitlines()
        if "eval/accuracy" in x
    ]
    assert len(evals) >= 2  # before and after


#: a local Ray cluster for the trainer's actor (the ``ray`` placement's options)
RAY = {"num_cpus": 2, "trainer_cpus": 1, "object_store_mb": 80, "ready_timeout_s": 60}


def test_lora_run_syncs_merged_weights(model_dir: Path, tmp_path: Path) -> None:
    """LoRA adapters on the UNet (peft): the engine samples with the merged weights
    (``W + s B A``), the trainer computes ``W x + s B (A x)``: the same function, rounded
    differently, so after an update the step log-probs agree to about 1e-5, not bitwise."""
    config = _config(
        tmp_path,
        model_dir,
        "lora",
        backend={"name": "diffusion", "lr": 1e-2, "num_threads": 1, "lora_rank": 4},
        eval={"data": None},
    )
    out = _miles("train", str(config))
    assert out.returncode == 0, out.stderr[-5000:]
    rows = _check_run(tmp_path / "runs" / "lora", 2, mismatch=1e-4)
    assert rows[1]["train/mismatch/abs_max"] == 0.0  # the adapters start as the identity
    assert (tmp_path / "runs" / "lora" / "checkpoints" / "step_2" / "trainer" / "lora.pt").is_file()


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_async_disaggregated_run_through_each_other_transport(
    model_dir: Path, tmp_path: Path, transport: str
) -> None:
    """Fully asynchronous: the trainer in a Ray actor, the engine generating the next groups
    while it trains, the staleness bound kept by the buffer."""
    config = _config(
        tmp_path,
        model_dir,
        f"async-{transport}",
        run__mode="async",
        run__placement="disaggregated",
        transport={"name": transport},
        engine={"name": "diffusion", "num_threads": 1, "launch_in": "ray_actor"},
        buffer={"capacity": 4, "max_staleness": 1},
        eval={"data": None},
        plugins={"options": {"ray": RAY}},
    )
    out = _miles("train", str(config))
    assert out.returncode == 0, out.stderr[-5000:]
    rows = _check_run(tmp_path / "runs" / f"async-{transport}", 2)
    assert [r["weight_version"] for _, r in sorted(rows.items())] == [1.0, 2.0]
    for row in rows.values():
        assert row["staleness/consumed_max"] <= 1


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_continues_the_run(
    model_dir: Path, tmp_path: Path
) -> None:
    steps = 3
    full = _miles("train", str(_config(tmp_path, model_dir, "full", run__steps=steps)))
    assert full.returncode == 0, full.stderr[-5000:]

    config = _config(tmp_path, model_dir, "killed", run__steps=steps)
    run = tmp_path / "runs" / "killed"
    marker = run / "checkpoints" / "step_1" / "loop.json"
    err = (tmp_path / "killed.err").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_core.cli", "train", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=err,
        env=_env(),
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.is_file():
            assert proc.poll() is None, (tmp_path / "killed.err").read_text()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        err.close()
    assert not (run / "checkpoints" / f"step_{steps}").exists()

    resumed = _miles("train", str(config), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    a = _rows(tmp_path / "runs" / "full")
    b = _check_run(run, steps)
    # the resumed run continues as the uninterrupted one: same samples, same updates
    for step in range(1, steps + 1):
        assert _untimed(a[step]) == _untimed(b[step]), f"step {step} differs"


def test_a_reward_returning_nan_is_counted_and_never_trained_on(
    model_dir: Path, tmp_path: Path, site: Path
) -> None:
    config = _config(
        tmp_path,
        model_dir,
        "nan",
        reward="nan_on_three",
        eval={"data": None},
        data={"name": "digit_prompts", "size": 64, "seed": 1, "classes": [2, 3]},
    )
    out = _miles("train", str(config), site=site)
    assert out.returncode == 0, out.stderr[-5000:]
    rows = _rows(tmp_path / "runs" / "nan")
    ledger = json.loads((tmp_path / "runs" / "nan" / "ledger.json").read_text())
    assert ledger["trained"] == 4
    assert ledger["dropped.reward_failed"] > 0
    assert rows[2]["reward/failure_rate"] > 0


def test_bad_input_is_refused_at_start(model_dir: Path, tmp_path: Path) -> None:
    text_model = tmp_path / "text-model"
    text_model.mkdir()
    (text_model / "config.json").write_text('{"model_type": "qwen3"}')
    out = _miles("config", "validate", str(_config(tmp_path, text_model, "text-under-diffusion")))
    assert out.returncode != 0
    assert "is a text model" in out.stderr and "miles-diffusion pretrain-digits" in out.stderr

    out = _miles(
        "config", "validate",
        str(_config(tmp_path, model_dir, "size", modality={"name": "diffusion",
            "sample_size": 16, "channels": 1, "num_classes": 4})),
    )  # fmt: skip
    assert out.returncode != 0
    assert "modality.sample_size is 16 but the model's is 8" in out.stderr

    # a diffusion model under the text modality, with text components
    cfg = yaml.safe_load(_config(tmp_path, model_dir, "diffusion-under-text").read_text())
    cfg.pop("modality")
    cfg.update(
        backend={"name": "fsdp2"},
        engine={"name": "embedded"},
        algorithm={"name": "grpo"},
        reward={"name": "reasoning_gym"},
        data={"name": "reasoning_gym", "task": "chain_sum", "size": 4},
    )
    path = tmp_path / "diffusion-under-text.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = _miles("config", "validate", str(path))
    assert out.returncode != 0
    assert "is a diffusion model (diffusers layout)" in out.stderr

    # diffusion components under the text modality are refused by name
    cfg = yaml.safe_load(_config(tmp_path, model_dir, "mixed").read_text())
    cfg.pop("modality")
    path.write_text(yaml.safe_dump(cfg))
    out = _miles("config", "validate", str(path))
    assert out.returncode != 0
    assert "trainer backend 'diffusion' requires modality in {diffusion}" in out.stderr
