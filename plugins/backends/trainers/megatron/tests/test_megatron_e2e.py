"""End to end on the Megatron backend: two RL steps of the synchronous loop with tensor
parallel 2 on gloo, the embedded engine process and the colocated transport; two steps of the
fully asynchronous loop under Ray disaggregated placement with the broadcast transport; two
steps of PPO (a critic beside the policy) at tensor parallel 2; and bad input refused by
``miles train`` before any work, with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import save_tiny_qwen3, train, write_dist

DIVERSITY = """
from miles_core import RewardFunction, hookimpl

def build(options):
    return lambda sample, prompt: (sum(sample.response_ids) % 1000) / 1000

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="diversity", factory=build))
"""


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real Qwen vocabulary and 2 key/value heads, so tensor
    parallel 2 divides it."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", heads=4, kv_heads=2)


def _config(tmp_path: Path, model: Path, backend: dict) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(16)
        )
    )
    cfg = {
        "run": {"name": "mg", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "megatron", "lr": 1e-2, **backend},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """The ``diversity`` reward (a hash of the response: a learning signal for a random
    model), installed in a folder the subprocess puts on its path."""
    return write_dist(
        tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY, "diversity"
    )


@pytest.mark.slow
def test_two_rl_steps_with_tensor_parallel_2(tiny_qwen3: Path, tmp_path: Path, site: Path) -> None:
    out = train(_config(tmp_path, tiny_qwen3, {"tensor_parallel": 2}), site=site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [
        json.loads(r) for r in (tmp_path / "runs" / "mg" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:
        assert s["train/grad_norm"] > 0 and s["sync/bytes"] > 0
    # After the first sync the engine samples with exactly the trainer's weights: its
    # log-probs and the trainer's recomputed ones agree only if the whole TP-gathered update
    # arrived under the right Hugging Face names.
    assert steps[1]["train/mismatch/abs_max"] < 1e-4, steps[1]["train/mismatch/abs_max"]


@pytest.mark.slow
def test_async_disaggregated_under_ray(tiny_qwen3: Path, tmp_path: Path, site: Path) -> None:
    """The trainer's two pipeline ranks each in a Ray actor, the engine in another, gloo
    broadcast weight sync, the asynchronous schedule."""
    config = yaml.safe_load(_config(tmp_path, tiny_qwen3, {"pipeline_parallel": 2}).read_text())
    config["run"].update({"mode": "async", "placement": "disaggregated"})
    config["engine"].update({"launch_in": "ray_actor", "ray_num_cpus": 1, "num_threads": 1})
    config["backend"]["cpu_threads"] = 1
    config["transport"] = {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60}
    config["algorithm"] = {"name": "grpo", "behaviour_policy": "rollout"}
    config.pop("eval")
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    # each of the two pipeline ranks and the engine reserve one logical CPU
    ray = "{num_cpus: 3, trainer_cpus: 1, object_store_mb: 80, ready_timeout_s: 60}"
    out = train(path, site=site, env={"MILES_RAY": ray}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [
        json.loads(r) for r in (tmp_path / "runs" / "mg" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0]
    assert all(r["train/grad_norm"] > 0 and r["sync/bytes"] > 0 for r in rows)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"tensor_parallel": 3}, "backend.tensor_parallel: tensor_parallel=3 does not divide"),
        (
            {"pipeline_parallel": 3},
            "backend.pipeline_parallel: pipeline_parallel=3 does not divide",
        ),
    ],
)
def test_bad_split_is_refused_before_any_work(
    tiny_qwen3: Path, tmp_path: Path, site: Path, backend: dict, message: str
) -> None:
    out = train(_config(tmp_path, tiny_qwen3, backend), site=site)
    assert out.returncode == 2, out.stderr[-3000:]
    assert message in out.stderr and "allowed" in out.stderr
    assert not (tmp_path / "runs" / "mg").exists()  # refused before the run folder was made


def test_unknown_architecture_and_mismatched_checkpoint_are_refused(
    tiny_qwen3: Path, tmp_path: Path, site: Path
) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    out = train(_config(tmp_path, model, {}), site=site)
    assert out.returncode == 2 and "model.path: model architecture 'GPT2LMHeadModel'" in out.stderr
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    out = train(_config(tmp_path, model, {}), site=site)
    assert out.returncode == 2 and "but the config says [48, 32]" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_ppo_two_steps_with_tensor_parallel_2(tiny_qwen3: Path, tmp_path: Path, site: Path) -> None:
    """``algorithm: ppo`` on megatron: the critic trains beside the policy (TP 2) for two
    steps of the synchronous loop; the loop's checkpoint holds the critic, and the weight
    stream carries the policy only (the engine agrees with the trainer after the sync)."""
    config = yaml.safe_load(_config(tmp_path, tiny_qwen3, {"tensor_parallel": 2}).read_text())
    config["algorithm"] = {"name": "ppo"}
    config["backend"]["critic"] = {"lr": 1e-2}
    config["run"]["checkpoint_every"] = 2
    config.pop("eval")
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(config))
    out = train(path, site=site)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    run = tmp_path / "runs" / "mg"
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "eval/accuracy" not in r]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:
        assert s["train/loss/value"] > 0 and s["train/critic/grad_norm"] > 0
        assert s["train/critic/lr"] == 1e-2 and s["train/grad_norm"] > 0
        assert s["train/explained_variance"] <= 1.0
        assert s["train/critic/skipped_nonfinite"] == 0.0
    assert steps[1]["train/mismatch/abs_max"] < 1e-4, steps[1]["train/mismatch/abs_max"]
    import torch

    meta = torch.load(run / "checkpoints" / "step_2" / "trainer" / "trainer.pt", weights_only=False)
    assert meta["critic"]["scheduler"]["_step_count"] == 3  # two critic steps
    rank0 = torch.load(run / "checkpoints" / "step_2" / "trainer" / "rank0.pt", weights_only=False)
    assert "value_head.weight" in rank0["critic"]
