"""The ``diffusion`` trainer backend on groups of the ``diffusion_sample`` rollout function."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from miles_diffusion.grpo import StepGRPO
from miles_diffusion.options import DiffusionTrainerOptions, StepGRPOOptions
from miles_diffusion.policy import from_pretrained
from miles_diffusion.rewards import ImageBrightness
from miles_diffusion.rollout import DiffusionSample
from miles_diffusion.testing import tiny_options, write_tiny_model
from miles_diffusion.trainer import DiffusionTrainer, sampler_of

from miles_core.contracts import Trainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-diffusion"))


def _groups(model_dir: Path, n_groups: int = 2, size: int = 3, policy: Any = None) -> list[Any]:
    policy = policy or from_pretrained(str(model_dir), tiny_options())
    fn = DiffusionSample()

    async def go() -> list[Any]:
        return [
            await fn({"label": g % 4, "seed": 10 + g}, group_size=size, engine=policy,
                     reward=ImageBrightness())
            for g in range(n_groups)
        ]  # fmt: skip

    groups = asyncio.run(go())
    for i, g in enumerate(groups):
        g.group_id = i
    return groups


def _trainer(model_dir: Path, **options: Any) -> DiffusionTrainer:
    trainer = DiffusionTrainer(DiffusionTrainerOptions(**options))
    trainer.setup(str(model_dir))
    return trainer


def test_trainer_recomputes_the_sampled_logprobs_and_learns(model_dir: Path) -> None:
    groups = _groups(model_dir)
    trainer = _trainer(model_dir, lr=1e-3)
    assert isinstance(trainer, Trainer)
    lp, entropy = trainer.compute_logprobs(groups)
    sampled = torch.tensor([s.logprobs for g in groups for s in g.samples])
    assert entropy is None and lp.shape == sampled.shape
    assert (lp - sampled).abs().max().item() <= 1e-5
    before = {k: v.clone() for k, v in trainer.export_weights()}
    metrics = trainer.train_step(groups, StepGRPO())
    assert metrics["mismatch/abs_max"] <= 1e-5
    assert trainer.weight_version == 1
    after = dict(trainer.export_weights())
    assert set(after) == set(before)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the exported names are the engine's: a policy over the same folder loads them
    policy = from_pretrained(str(model_dir), tiny_options())
    policy.unet.load_state_dict(after)


def test_kl_to_the_reference_uses_the_starting_weights(model_dir: Path) -> None:
    groups = _groups(model_dir)
    trainer = _trainer(model_dir, lr=1e-3)
    algo = StepGRPO(StepGRPOOptions(kl_coef=0.5))
    assert algo.needs == {"ref_logprobs"}
    first = trainer.train_step(groups, algo)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # before any update: the same
    second = trainer.train_step(groups, algo)
    assert second["kl_ref"] > 0.0


def test_save_and_load_continue_bitwise(model_dir: Path, tmp_path: Path) -> None:
    groups = _groups(model_dir)
    a = _trainer(model_dir, lr=1e-3)
    a.train_step(groups, StepGRPO())
    a.save(str(tmp_path / "ckpt"), extra={"note": 1})
    # the checkpoint is itself a diffusion model folder
    assert from_pretrained(str(tmp_path / "ckpt"), tiny_options()) is not None
    b = _trainer(model_dir, lr=1e-3)
    b.load(str(tmp_path / "ckpt"))
    assert b.weight_version == 1 and b.extra == {"note": 1}
    ma, mb = a.train_step(groups, StepGRPO()), b.train_step(groups, StepGRPO())
    assert ma["loss"] == mb["loss"]
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(FileNotFoundError, match="not a diffusion trainer checkpoint"):
        b.load(str(tmp_path))


def test_mixed_samplers_and_foreign_samples_are_refused(model_dir: Path) -> None:
    groups = _groups(model_dir, n_groups=1)
    other = _groups(model_dir, n_groups=1, policy=from_pretrained(
        str(model_dir), tiny_options(num_inference_steps=2)))  # fmt: skip
    with pytest.raises(ValueError, match="one step trains samples of one sampler"):
        sampler_of(groups + other)
    del groups[0].samples[0].metadata["sampler"]
    with pytest.raises(ValueError, match="no metadata\\['sampler'\\]"):
        sampler_of(groups)


def test_lora_trains_adapters_only_and_exports_merged_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    groups = _groups(model_dir)
    trainer = _trainer(model_dir, lr=1e-2, lora_rank=4)
    base = {k: v.clone() for k, v in trainer.export_weights()}
    # adapters start as the identity: the recomputed log-probs are the sampled ones
    lp, _ = trainer.compute_logprobs(groups)
    sampled = torch.tensor([s.logprobs for g in groups for s in g.samples])
    assert torch.equal(lp, sampled)
    trainer.train_step(groups, StepGRPO())
    frozen = [n for n, p in trainer.unet.named_parameters() if not p.requires_grad]
    assert frozen and all(".lora_" not in n for n in frozen)
    merged = dict(trainer.export_weights())
    assert set(merged) == set(base)  # the engine's names, no adapter tensors
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith(".weight") for k in changed)
    # a policy over the merged weights gives the trainer's log-probs (to float rounding)
    policy = from_pretrained(str(model_dir), tiny_options())
    policy.unet.load_state_dict(merged)
    policy_groups = _groups(model_dir, policy=policy)
    again, _ = trainer.compute_logprobs(policy_groups)
    redrawn = torch.tensor([s.logprobs for g in policy_groups for s in g.samples])
    assert (again - redrawn).abs().max().item() < 1e-4
    # a checkpoint: the merged model folder, and the adapters for a resume
    trainer.save(str(tmp_path / "ckpt"))
    resumed = _trainer(model_dir, lr=1e-2, lora_rank=4)
    resumed.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(merged[k], v) for k, v in resumed.export_weights())
    saved = from_pretrained(str(tmp_path / "ckpt"), tiny_options())
    assert all(torch.equal(merged[k], v) for k, v in saved.unet.state_dict().items())


def test_grid_command_draws_a_row_per_class(model_dir: Path, tmp_path: Path) -> None:
    from miles_diffusion.cli import main
    from PIL import Image

    out = tmp_path / "grid.png"
    assert (
        main(["grid", str(model_dir), "--out", str(out), "--per-class", "3", "--steps", "4"]) == 0
    )
    width, height = Image.open(out).size
    assert (width, height) == (3 * 33 + 1, 4 * 33 + 1)  # 8x8 images at 4x, 1 px apart
    assert main(["grid", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
