"""The CUDA / NCCL path (Transformer Engine's layer spec when TE is installed); skipped on a
machine without a GPU (where it ran: `benchmarks/results/megatron.md`)."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_megatron import cpu_compat
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_no_cpu_patch_on_a_gpu() -> None:
    assert not cpu_compat.needed() and not cpu_compat.apply()


def test_cpu_is_refused_on_a_cuda_machine(qwen3_path: str) -> None:
    """The CPU patches apply only without CUDA, so device 'cpu' is refused with the reason."""
    with pytest.raises(Exception, match="only on a machine without CUDA"):
        trainer = build(MegatronOptions(lr=1e-3, cpu_threads=1))
        try:
            trainer.setup(qwen3_path)
        finally:
            trainer.close()


def _specs() -> list[str]:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return ["local"]
    return ["local", "transformer_engine"]


@pytest.mark.parametrize("layer_spec", _specs())
def test_cuda_logprobs_step_sleep_wake(
    qwen3_path: str, groups, engine_logprobs, layer_spec: str
) -> None:
    g = groups(2, 4, seed=31)
    # a plain Hugging Face forward on the CPU (a Megatron CPU trainer cannot run beside CUDA)
    rows = engine_logprobs(qwen3_path, g, invariant=False)
    expected = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, row in enumerate(rows):
        expected[i, : len(row)] = torch.tensor(row)
    trainer = build(MegatronOptions(device="cuda", lr=1e-3, layer_spec=layer_spec))
    trainer.setup(qwen3_path)
    lp, _ = trainer.compute_logprobs(g)
    assert lp.device.type == "cpu"
    torch.testing.assert_close(lp, expected, atol=1e-3, rtol=0)  # TE kernels: not bitwise
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    trainer.train_step(g, algo)
    _sleep_frees_and_wake_restores(trainer, g, algo)


def test_cuda_true_on_policy_bitwise(qwen3_path: str, groups, engine_logprobs) -> None:
    """True on-policy mode on the GPU: the trainer's log-probs are bitwise the Hugging Face
    forward's in the mode on the same GPU (the engine's), where the CUDA kernels choose their
    own blocking."""
    g = groups(3, 4, seed=9)
    expected = engine_logprobs(qwen3_path, g, "cuda")
    trainer = build(
        MegatronOptions(device="cuda", lr=1e-3, micro_batch_tokens=40), true_on_policy=True
    )
    try:
        trainer.setup(qwen3_path)
        lp, _ = trainer.compute_logprobs(g)
        worst = max(
            float((lp[i, : len(row)] - torch.tensor(row)).abs().max())
            for i, row in enumerate(expected)
        )
        assert worst == 0.0, worst
    finally:
        trainer.close()


def test_cuda_distributed_optimizer(qwen3_path: str, groups) -> None:
    """Megatron's distributed optimizer on one GPU (one replica: its shard is the whole
    model; Transformer Engine's fused Adam inside when TE is installed): two steps give the
    AdamW path's weights, and sleep/wake offloads its buffers and restores them exactly."""
    g = groups(2, 4, seed=31)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    opts = dict(device="cuda", lr=1e-3, eps=1e-3, max_grad_norm=0.5, layer_spec="local")
    out = []
    for sharded in (False, True):
        trainer = build(MegatronOptions(**opts, distributed_optimizer=sharded))
        try:
            trainer.setup(qwen3_path)
            for _ in range(2):
                assert trainer.train_step(g, algo)["skipped_nonfinite"] == 0
            out.append(dict(trainer.export_weights()))
            if sharded:
                _sleep_frees_and_wake_restores(trainer, g, algo)
        finally:
            trainer.close()
    reference, weights = out
    for name, ref in reference.items():
        rel = float((weights[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert rel < 1e-4, (name, rel)  # a fused Adam's float order may differ from torch's


def _sleep_frees_and_wake_restores(trainer, g, algo) -> None:
    """``sleep`` frees most of the GPU memory; ``wake`` brings back the same weights and
    optimizer state, and the next step trains."""
    before = trainer.fingerprint()
    awake = torch.cuda.memory_allocated()
    trainer.sleep()
    assert torch.cuda.memory_allocated() < awake / 4
    trainer.wake()
    assert trainer.fingerprint() == before
    assert trainer.train_step(g, algo)["skipped_nonfinite"] == 0
