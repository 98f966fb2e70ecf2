"""save/load: resuming gives bitwise the same weights, optimizer state and next step."""

from __future__ import annotations

import os

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build

OPTIONS = FSDP2Options(
    lr=5e-3,
    weight_decay=0.1,
    warmup_steps=1,
    lr_schedule="cosine",
    decay_steps=6,
    min_lr_ratio=0.1,
    micro_batch_tokens=30,
    cpu_threads=1,
)


def test_resume_is_bitwise(llama_path: str, groups, tmp_path) -> None:
    g = groups(seed=11)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    first = build(OPTIONS)
    first.setup(llama_path)
    first.train_step(g, algo)
    first.train_step(g, algo)
    saved = first.fingerprint()
    ckpt = str(tmp_path / "ckpt")
    extra = {"data_position": 17, "ledger": {"trained": 4, "dropped": {"stale": 1}}}
    first.save(ckpt, extra=extra)
    rng = torch.get_rng_state()
    assert {"trainer.pt", "rng_rank0.pt", "sharded"} <= set(os.listdir(ckpt))
    third = first.train_step(g, algo)
    expected = first.fingerprint()

    torch.manual_seed(1234)  # the load must bring the RNG back
    resumed = build(OPTIONS)
    resumed.setup(llama_path)
    assert resumed.fingerprint() != saved
    resumed.load(ckpt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert resumed.weight_version == 2
    assert resumed.extra == extra
    assert resumed.fingerprint() == saved
    again = resumed.train_step(g, algo)
    assert resumed.weight_version == 3
    assert resumed.fingerprint() == expected
    assert again["lr"] == third["lr"] and again["loss"] == third["loss"]
    assert again["grad_norm"] == third["grad_norm"]


def test_load_of_a_missing_checkpoint_is_an_error(llama_path: str, tmp_path) -> None:
    trainer = build(FSDP2Options(cpu_threads=1))
    trainer.setup(llama_path)
    with pytest.raises(FileNotFoundError, match="no fsdp2 checkpoint"):
        trainer.load(str(tmp_path / "nothing"))


def test_save_before_the_first_step_changes_nothing(llama_path: str, groups, tmp_path) -> None:
    g = groups(seed=12)
    algo = build_policy_gradient(GRPOOptions())
    saved = build(OPTIONS)
    saved.setup(llama_path)
    never = build(OPTIONS)
    never.setup(llama_path)
    ckpt = str(tmp_path / "step0")
    saved.save(ckpt)
    saved.save(ckpt)  # saving again to the same folder replaces it
    resumed = build(OPTIONS)
    resumed.setup(llama_path)
    resumed.load(ckpt)
    for trainer in (saved, never, resumed):
        trainer.train_step(g, algo)
    assert saved.fingerprint() == never.fingerprint() == resumed.fingerprint()
