"""The CUDA / NCCL path (Transformer Engine's layer spec when TE is installed); skipped on a
machine without a GPU (see the README for where it ran)."""

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


def _specs() -> list[str]:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return ["local"]
    return ["local", "transformer_engine"]


@pytest.mark.parametrize("layer_spec", _specs())
def test_cuda_logprobs_step_sleep_wake(qwen3_path: str, groups, layer_spec: str) -> None:
    g = groups(2, 4, seed=31)
    reference = build(MegatronOptions(lr=1e-3, cpu_threads=1))  # the CPU path, checked vs HF
    reference.setup(qwen3_path)
    expected, _ = reference.compute_logprobs(g)
    trainer = build(MegatronOptions(device="cuda", lr=1e-3, layer_spec=layer_spec))
    trainer.setup(qwen3_path)
    lp, _ = trainer.compute_logprobs(g)
    assert lp.device.type == "cpu"
    torch.testing.assert_close(lp, expected, atol=1e-3, rtol=0)  # TE kernels: not bitwise
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    trainer.train_step(g, algo)
    before = trainer.fingerprint()
    awake = torch.cuda.memory_allocated()
    trainer.sleep()
    assert torch.cuda.memory_allocated() < awake / 4
    trainer.wake()
    assert trainer.fingerprint() == before
    assert trainer.train_step(g, algo)["skipped_nonfinite"] == 0
