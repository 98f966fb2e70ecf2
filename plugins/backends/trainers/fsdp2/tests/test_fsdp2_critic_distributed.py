"""World size 2 with a critic: two spawned ranks give PPO's update of one (policy and critic),
and save / load / sleep / wake carry the critic across both ranks."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import PPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build

pytestmark = pytest.mark.slow

OPTS = dict(lr=1e-3, eps=1e-3, micro_batch_tokens=30, cpu_threads=1, critic={"lr": 1e-3})


def test_two_ranks_train_the_critic_as_one(llama_path: str, groups, tmp_path) -> None:
    g = groups(n_groups=3, group_size=3, seed=41)
    algo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed"))
    one = build(FSDP2Options(world_size=1, **OPTS))
    one.setup(llama_path)
    v1_before = one.compute_values(g)
    m1 = one.train_step(g, algo)
    v1 = one.compute_values(g)
    one.close()

    with build(FSDP2Options(world_size=2, **OPTS)) as two:
        two.setup(llama_path)
        torch.testing.assert_close(two.compute_values(g), v1_before, atol=1e-6, rtol=0)
        m2 = two.train_step(g, algo)
        assert m2["micro_batches"] == m1["micro_batches"] > 2  # the ranks split the work
        for key in ("loss", "loss/value", "explained_variance"):
            assert m2[key] == pytest.approx(m1[key], abs=1e-6), key
        assert m2["critic/grad_norm"] == pytest.approx(m1["critic/grad_norm"], rel=1e-5)
        assert m2["critic/grad_norm"] > 0
        # The critic's update is the same: its values after the step agree.
        torch.testing.assert_close(two.compute_values(g), v1, atol=1e-5, rtol=0)
        assert not torch.allclose(v1, v1_before)

        ckpt = str(tmp_path / "ckpt")
        two.save(ckpt)
        saved = two.fingerprint()
        assert {"critic", "critic_optimizer"} <= set(saved)
        two.train_step(g, algo)
        after = two.fingerprint()
        two.load(ckpt)
        assert two.fingerprint() == saved
        two.sleep()
        two.wake()
        two.train_step(g, algo)
        assert two.fingerprint() == after
