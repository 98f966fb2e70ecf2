"""True on-policy mode end to end (``rollout.true_on_policy``): `miles train` on a tiny model,
the embedded engine batching requests of many lengths, the FSDP2 and Megatron trainers over
micro-batches of several sizes, for a dense model (both backends) and a mixture of experts
(FSDP2). Every trained token's log-prob is bitwise the engine's, the first micro-step's PPO
ratio is exactly 1, and the trainer fails a step where one token differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_support import DIVERSITY, QWEN3_TOKENS, assert_ran, save_tiny_qwen3, train, write_dist

from miles_core.testing.tiny_moe import save_tiny_moe


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top-2; the second layer dense), weights scaled so its
    routers' choices are peaked."""
    return save_tiny_moe(
        tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", "qwen3_moe", seed=4,
        vocab_size=QWEN3_TOKENS, dense_layers=(1,), scale=4.0,
    )  # fmt: skip


@pytest.fixture
def reward_site(tmp_path: Path) -> Path:
    return write_dist(
        tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY, "diversity"
    )


def _config(tmp_path: Path, model: Path, backend: str = "fsdp2", **rollout: object) -> Path:
    data = tmp_path / "prompts.jsonl"
    # prompts of many lengths: the engine batches requests of different lengths together
    data.write_text(
        "".join(
            json.dumps({"prompt": "Add " + " and ".join(str(j) for j in range(i % 7 + 1)) + ".",
                        "answer": i})
            + "\n"
            for i in range(40)
        )
    )  # fmt: skip
    cfg = {
        "run": {"name": "top", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        # micro-batches of a few sequences each, so the trainer's batches differ in size
        "backend": {"name": backend, "lr": 1e-2, "micro_batch_tokens": 96},
        "engine": {"name": "embedded", "max_running_requests": 5},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {
            "group_size": 4,
            "groups_per_step": 3,
            "max_new_tokens": 12,
            "true_on_policy": True,
            **rollout,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "backend"),
    [("tiny_qwen3", "fsdp2"), ("tiny_qwen3_moe", "fsdp2"), ("tiny_qwen3", "megatron")],
)
def test_every_trained_token_is_bitwise_the_engines(
    model: str, backend: str, reward_site: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A dense model, and a mixture of experts (its routers choose the same experts on both
    sides, each token's expert outputs added in the same order); and the dense model on the
    Megatron backend (the engine's operations in its layer spec's own modules)."""
    out = train(_config(tmp_path, request.getfixturevalue(model), backend), site=reward_site)
    assert_ran(out)
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "top" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "train/loss" in r]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["train/mismatch/abs_max"] == 0.0 and s["train/mismatch/abs_mean"] == 0.0
        assert s["train/mismatch/kl"] == 0.0
        # the first (and only) micro-step: the ratio to the behaviour policy is exactly 1
        assert s["train/ratio/max"] == 1.0 and s["train/ratio/min"] == 1.0
        assert s["train/micro_batches"] > 1  # the trainer's batches were split
        assert s["train/grad_norm"] > 0


def _problems(raw: dict, registry) -> str:
    from miles_core.config import validate_config
    from miles_core.errors import MilesUserError

    with pytest.raises(MilesUserError) as err:
        validate_config(raw, registry)
    return str(err.value)


def test_refused_at_start_with_the_reason(tmp_path: Path, tiny_qwen3: Path) -> None:
    from miles_core.plugins import collect_registry, create_plugin_manager

    registry = collect_registry(create_plugin_manager())
    raw = yaml.safe_load(_config(tmp_path, tiny_qwen3).read_text())
    raw["reward"] = "exact_match"
    raw["run"].update(mode="async")
    raw["engine"] = {"name": "sglang"}
    raw["backend"] = {"name": "diffusion"}
    text = _problems(raw, registry)
    assert "rollout.true_on_policy: trainer backend 'diffusion' (backend.name)" in text
    assert "backends that do: fsdp2, megatron" in text
    assert "rollout.true_on_policy: engine 'sglang' (engine.name)" in text
    assert "engines that do: embedded" in text
    assert "run.mode 'async'" in text

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    raw = yaml.safe_load(_config(tmp_path, moe).read_text())
    raw["reward"] = "exact_match"
    raw["rollout"]["routing"] = "replay"
    text = _problems(raw, registry)
    assert "model_type 'deepseek_v3' has no batch-invariant forward" in text
    assert "rollout.true_on_policy: the trainer's routers compute the engine's expert" in text

    # the engine server refuses what its kernels do not cover
    from miles_engine_embedded.server import build_parser, true_on_policy_refusal

    def refusal(*flags: str) -> str | None:
        args = ["--model-path", str(tiny_qwen3), "--true-on-policy", *flags]
        return true_on_policy_refusal(build_parser().parse_args(args))

    assert refusal() is None
    assert "needs --dtype float32" in (refusal("--dtype", "bfloat16") or "")
    assert "LoRA" in (refusal("--enable-lora") or "")

    # the trainer's own options: bf16 compute is refused by the backend when built
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    with pytest.raises(ValueError, match="precision must be 'fp32'"):
        build(FSDP2Options(precision="bf16"), true_on_policy=True)


def test_a_differing_token_fails_the_step_naming_it() -> None:
    import torch
    from miles_trainer_common.logprobs import OffPolicyTokens, check_on_policy

    engine = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    check_on_policy(engine.clone(), engine, mask, torch.tensor([0, 1]))
    trainer = engine.clone()
    trainer[1, 2] = 7.0  # padding: not trained, not compared
    check_on_policy(trainer, engine, mask, torch.tensor([0, 1]))
    trainer[1, 1] = torch.nextafter(torch.tensor(-0.25), torch.tensor(0.0))
    named = r"1 of 5 trained tokens differ.*sample 1 \(group 1\), response position 1"
    with pytest.raises(OffPolicyTokens, match=named):
        check_on_policy(trainer, engine, mask, torch.tensor([0, 1]))
