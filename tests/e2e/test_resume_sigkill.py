"""Kill -9 and resume: a run killed with SIGKILL right after a checkpoint, then resumed with
``--resume``, continues bitwise as the same run left uninterrupted would have.

Both runs use the real plugins (FSDP2 trainer, embedded engine process, colocated transport,
GRPO, qwen3 family) on a tiny model. The engine runs one request at a time
(``max_running_requests: 1``): its continuous batching otherwise groups requests by when they
arrive over HTTP, and a matmul over a batch of a different size rounds differently, so the
engine's log-probs (the old log-probs of the importance ratio) would differ in the last bits
between any two runs, killed or not. Sampling itself is seeded by run seed, step and prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from core_support import REPO, save_tiny_qwen3, train, write_dist, write_prompts

K, M = 2, 2  # killed after step K's checkpoint; M more steps after the resume

DIVERSITY = """
from miles_core import RewardFunction, hookimpl

def build(options):
    return lambda sample, prompt: (sum(sample.response_ids) % 1000) / 1000

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="resume_diversity", factory=build))
"""

# Metrics that measure time or speed: the only ones allowed to differ between the runs.
TIMING_SUFFIXES = ("_s", "per_s", "seconds", "_fraction")


def _timing(key: str) -> bool:
    return key == "time" or key.startswith("time/") or key.endswith(TIMING_SUFFIXES)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary size (the qwen3 family's ids)."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An installed distribution providing the test reward."""
    return write_dist(
        tmp_path / "site", "miles-resume-reward", "miles_resume_reward", DIVERSITY, "resume_reward"
    )


def _config(tmp_path: Path, model: Path, name: str) -> Path:
    data = write_prompts(tmp_path / "prompts.jsonl", 40)
    cfg = {
        "run": {
            "name": name,
            "output_dir": str(tmp_path / "runs"),
            "steps": K + M,
            "checkpoint_every": 1,
            "seed": 7,
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 1},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "resume_diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": True, "seed": 3},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env["PYTHONPATH"] = str(site)
    return env


def _stat(pid: int) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()  # state, ppid, ...


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process under ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(pid)
    return found


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie has exited


def _rows(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not _timing(k)} for r in rows}


def _canonical(obj: object) -> object:
    """Loaded checkpoint content in a comparable form (tensors by dtype, shape and bytes)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return (
            "tensor",
            str(t.dtype),
            tuple(t.shape),
            hashlib.sha256(t.numpy().tobytes()).hexdigest(),
        )
    if isinstance(obj, dict):
        return sorted((repr(k), _canonical(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return repr(obj)


def _checkpoint_digest(step_dir: Path) -> dict[str, str]:
    """sha256 of every checkpoint file's content. Pickled files (``.pt``) are compared by what
    they hold, since equal objects can pickle to different bytes (shared references); DCP's
    ``.metadata`` also names the folder and a random save id, so only its tensor layout and
    planner data count; the tensor data file is compared byte for byte."""
    import torch

    out = {}
    for f in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        rel = str(f.relative_to(step_dir))
        if f.name == "manifest.json":  # the files' bytes (``.metadata``'s save id included)
            continue
        if f.name == ".metadata":
            meta = pickle.loads(f.read_bytes())
            data = pickle.dumps((meta.state_dict_metadata, meta.planner_data))
        elif f.name == "loop.json":
            data = json.dumps(json.loads(f.read_text()), sort_keys=True).encode()
        elif f.suffix == ".pt":
            data = repr(_canonical(torch.load(f, weights_only=False))).encode()
        else:
            data = f.read_bytes()
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


FINGERPRINTS = """
import json, sys
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import FSDP2Trainer
trainer = FSDP2Trainer(FSDP2Options(lr=1e-2))
trainer.setup(sys.argv[1])
for path in sys.argv[2:]:
    trainer.load(path)
    print(json.dumps(trainer.fingerprint()))
trainer.close()
"""


def _fingerprints(model: Path, *checkpoints: Path) -> list[dict[str, str]]:
    """The trainer state a run resumed from each checkpoint starts with: sha256 of the weights
    and of the optimizer (moments, schedule, step), read by the FSDP2 backend itself."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            FINGERPRINTS,
            str(model),
            *(str(c / "trainer") for c in checkpoints),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_continues_bitwise(
    tiny_model: Path, site: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    full = train(_config(tmp_path, tiny_model, "full"), site=site)
    assert full.returncode == 0, full.stderr[-5000:]
    # not a terminal: no live bar, but a line per step with its rates, and JSON last on stdout
    assert "train: " not in full.stderr
    assert f"step {K + M}/{K + M} | reward" in full.stderr
    assert "samples/s" in full.stderr and "tokens/s" in full.stderr and "eta " in full.stderr
    assert json.loads(full.stdout.strip().splitlines()[-1])["steps"] == K + M

    config = _config(tmp_path, tiny_model, "killed")
    killed_run = runs / "killed"
    marker = killed_run / "checkpoints" / f"step_{K}" / "loop.json"
    log = (tmp_path / "killed.out").open("w"), (tmp_path / "killed.err").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_core.cli", "train", str(config)],
        stdout=log[0],
        stderr=log[1],
        env=_env(site),
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 400
        while not marker.is_file():
            assert proc.poll() is None, (tmp_path / "killed.err").read_text()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        children = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None and proc.returncode is None:
            proc.kill()  # the wait above failed: do not leave the run behind
        proc.wait(timeout=60)
        for f in log:
            f.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed_run / "checkpoints" / f"step_{K + 1}" / "loop.json").exists()
    engines = [pid for pid, cmd in children.items() if "miles_engine_embedded.server" in cmd]
    assert engines, f"no engine process under the run: {children}"
    # The engine runs in a session of its own; the run's guard stops it (and then itself).
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: cmd for pid, cmd in children.items() if _running(pid)}
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left after the kill: {left}"
    assert f"step {K}/{K + M}" in (tmp_path / "killed.err").read_text()

    resumed = train(config, "--resume", site=site)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == K + M

    # The state a step K+1 starts from: equal trainer state (weights, optimizer moments,
    # schedule, step), data position, ledger and counters in the two runs.
    start_full, start_killed = _fingerprints(
        tiny_model,
        runs / "full" / "checkpoints" / f"step_{K}",
        killed_run / "checkpoints" / f"step_{K}",
    )
    assert start_full == start_killed
    for step in range(K, K + M + 1):
        a = _checkpoint_digest(runs / "full" / "checkpoints" / f"step_{step}")
        b = _checkpoint_digest(killed_run / "checkpoints" / f"step_{step}")
        assert {"loop.json", "trainer/sharded/__0_0.distcp", "trainer/rng_rank0.pt"} <= set(a)
        assert a == b, f"checkpoint of step {step} differs"

    # Every metric but timings equal, bitwise, before the kill and after the resume.
    full_rows, killed_rows = _rows(runs / "full"), _rows(killed_run)
    assert sorted(full_rows) == sorted(killed_rows) == list(range(1, K + M + 1))
    compared = set(full_rows[K + 1])
    assert {"reward/mean", "train/loss", "train/grad_norm", "train/mismatch/abs_max"} <= compared
    assert {"ledger/trained", "data/skipped_rows", "weight_version"} <= compared
    for step in range(1, K + M + 1):
        assert killed_rows[step] == full_rows[step], f"step {step} differs"
    assert len({full_rows[s]["train/loss"] for s in full_rows}) > 1  # the steps did differ
