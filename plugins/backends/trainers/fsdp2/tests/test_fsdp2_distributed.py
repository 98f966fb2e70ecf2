"""World size 2: two spawned worker processes on a real gloo group give the update of one."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient, build_sft
from miles_algorithms.options import GRPOOptions, SFTOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build
from miles_trainer_common.processes import WorkerError

pytestmark = pytest.mark.slow

ALGO = GRPOOptions(behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01)
# eps = 1e-3 for the reason given in test_fsdp2_train.py (near-cancelling GRPO gradients).
OPTS = dict(lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, micro_batch_tokens=30)


def _workers_alive() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith("miles-fsdp2")]


def test_two_ranks_equal_one(llama_path: str, groups, tmp_path) -> None:
    g = groups(n_groups=3, group_size=3, seed=21)
    algo = build_policy_gradient(ALGO)
    one = build(FSDP2Options(world_size=1, cpu_threads=1, **OPTS))
    one.setup(llama_path)
    lp1, ent1 = one.compute_logprobs(g)
    m1 = one.train_step(g, algo)
    w1 = dict(one.export_weights())
    # One sample: a single micro-batch, so with two ranks one of them runs a padding pass.
    small = [type(g[0])(samples=g[0].samples[:1])]
    alone = build_sft(SFTOptions())  # a gradient from a lone sample
    one.train_step(small, alone)
    w1_small = dict(one.export_weights())
    assert any(not torch.equal(w1_small[n], w1[n]) for n in w1)
    one.close()

    with build(FSDP2Options(world_size=2, cpu_threads=1, **OPTS)) as two:
        two.setup(llama_path)
        assert len(_workers_alive()) == 2
        lp2, ent2 = two.compute_logprobs(g)
        torch.testing.assert_close(lp2, lp1, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent2, ent1, atol=1e-6, rtol=0)
        m2 = two.train_step(g, algo)
        assert m2["micro_batches"] == m1["micro_batches"] > 2  # the ranks split the work
        assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert two.weight_version == 1

        # Streamed from rank 0, one tensor at a time; stopping early leaves the ranks in step.
        stream = two.export_weights()
        next(stream)
        with pytest.raises(RuntimeError, match="still open"):
            two.fingerprint()
        stream.close()
        w2 = dict(two.export_weights())
        assert list(w2) == list(w1)
        for name, tensor in w2.items():
            assert tensor.shape == w1[name].shape
            torch.testing.assert_close(tensor, w1[name], atol=1e-5, rtol=0, msg=name)
        assert two.train_step(small, alone)["micro_batches"] == 1
        for name, tensor in two.export_weights():
            torch.testing.assert_close(tensor, w1_small[name], atol=1e-5, rtol=0, msg=name)

        # save / load across both ranks: loading brings back the saved state bitwise.
        ckpt = str(tmp_path / "ckpt")
        two.save(ckpt, extra={"data_position": 3})
        saved = two.fingerprint()
        two.train_step(g, algo)
        after = two.fingerprint()
        two.load(ckpt)
        assert two.fingerprint() == saved and two.weight_version == 2
        assert two.extra == {"data_position": 3}
        two.sleep()
        two.wake()
        two.train_step(g, algo)
        assert two.fingerprint() == after
    assert _workers_alive() == []


def test_a_failing_rank_is_a_clear_error(tmp_path) -> None:
    trainer = build(FSDP2Options(world_size=2, cpu_threads=1))
    missing = str(tmp_path / "no-model-here")
    with pytest.raises(WorkerError, match=r"fsdp2 rank \d failed in setup") as info:
        trainer.setup(missing)
    assert "no-model-here" in str(info.value)
    assert _workers_alive() == []


def test_two_ranks_equal_one_on_a_mixture_of_experts(qwen3_moe_path: str, groups) -> None:
    """FSDP2 shards the fused 3-D expert tensors (4 experts: two per rank) and the routers;
    two ranks compute the log-probs, the step and the exported experts of one."""
    g = groups(n_groups=2, group_size=3, seed=22)
    algo = build_policy_gradient(ALGO)
    one = build(FSDP2Options(world_size=1, cpu_threads=1, **OPTS))
    one.setup(qwen3_moe_path)
    lp1, _ = one.compute_logprobs(g)
    m1 = one.train_step(g, algo)
    w1 = dict(one.export_weights())
    one.close()
    with build(FSDP2Options(world_size=2, cpu_threads=1, **OPTS)) as two:
        two.setup(qwen3_moe_path)
        lp2, _ = two.compute_logprobs(g)
        torch.testing.assert_close(lp2, lp1, atol=1e-6, rtol=0)
        m2 = two.train_step(g, algo)
        assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        w2 = dict(two.export_weights())
    assert list(w2) == list(w1)
    assert any(t.dim() == 3 for t in w2.values())  # the fused experts
    for name, tensor in w2.items():
        torch.testing.assert_close(tensor, w1[name], atol=1e-5, rtol=0, msg=name)
