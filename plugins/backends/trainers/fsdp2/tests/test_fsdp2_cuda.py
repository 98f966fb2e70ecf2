"""The CUDA / NCCL path; skipped on a machine without a GPU (where it ran:
`benchmarks/results/fsdp2.md`)."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_step_sleep_wake(llama_path: str, groups, hf, precision: str) -> None:
    g = groups(seed=31)
    trainer = build(FSDP2Options(device="cuda", precision=precision, lr=1e-3))
    trainer.setup(llama_path)
    lp, _ = trainer.compute_logprobs(g)
    assert lp.device.type == "cpu"
    with torch.no_grad():
        ref, _ = hf.logprobs(hf.model(llama_path), g)
    torch.testing.assert_close(lp, ref, atol=1e-4 if precision == "fp32" else 0.1, rtol=0)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    trainer.train_step(g, algo)
    before = trainer.fingerprint()
    awake = torch.cuda.memory_allocated()
    trainer.sleep()
    asleep = torch.cuda.memory_allocated()
    assert asleep < awake / 4, (awake, asleep)
    trainer.wake()
    assert trainer.fingerprint() == before
    metrics = trainer.train_step(g, algo)
    assert metrics["skipped_nonfinite"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_equal_one(llama_path: str, groups) -> None:
    g = groups(n_groups=3, group_size=3, seed=32)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed"))
    weights = []
    for world_size in (1, 2):
        with build(
            FSDP2Options(device="cuda", world_size=world_size, lr=1e-3, eps=1e-3)
        ) as trainer:
            trainer.setup(llama_path)
            trainer.train_step(g, algo)
            weights.append(dict(trainer.export_weights()))
    for name, tensor in weights[1].items():
        torch.testing.assert_close(tensor.cpu(), weights[0][name].cpu(), atol=1e-5, rtol=0)


def test_cuda_routing_replay(tmp_path) -> None:
    """Routing replay on CUDA: a tiny Qwen3-MoE trained on the GPU routes by the record it is
    given (agreement 1.0, the trainer's own top-k differing), and its replayed log-probs equal
    the CPU trainer's."""
    import random

    from miles_core.data import Group, RoutedExperts, Sample
    from miles_core.testing.tiny_moe import save_tiny_moe

    path = save_tiny_moe(tmp_path / "m", "qwen3_moe", seed=3, scale=4.0)
    layers, experts, k = 2, 4, 2
    rng = random.Random(0)
    groups = []
    for g in range(2):
        prompt = [1] + [rng.randrange(3, 120) for _ in range(4 + g)]
        samples = []
        for s in range(2):
            response = [rng.randrange(3, 120) for _ in range(5 + s)]
            rows = len(prompt) + len(response) - 1
            ids = [e for _ in range(rows * layers) for e in rng.sample(range(experts), k)]
            sample = Sample(prompt_ids=prompt, reward=float(s))
            sample.append(
                response,
                logprobs=[-1.0] * len(response),
                version=0,
                routed_experts=RoutedExperts.from_ids(ids, rows),
            )
            samples.append(sample)
        groups.append(Group(samples=samples))
    cpu = build(FSDP2Options(lr=1e-2, cpu_threads=1), routing="replay")
    gpu = build(FSDP2Options(device="cuda", lr=1e-2), routing="replay")
    try:
        cpu.setup(str(path))
        gpu.setup(str(path))
        expected, _ = cpu.compute_logprobs(groups)
        got, _ = gpu.compute_logprobs(groups)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        metrics = gpu.train_step(groups, build_policy_gradient(GRPOOptions()))
        assert metrics["routing/expert_agreement"] == 1.0
        assert metrics["routing/own_agreement"] < 1.0
        assert metrics["skipped_nonfinite"] == 0
    finally:
        cpu.close()
        gpu.close()
