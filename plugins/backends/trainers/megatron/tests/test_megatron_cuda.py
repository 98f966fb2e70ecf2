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


def hf_logprobs(path: str, groups: list) -> torch.Tensor:
    """The response tokens' log-probs ``[B, T]`` of a plain float32 Hugging Face forward on the
    CPU, one sample at a time (a Megatron CPU trainer cannot run on a machine with CUDA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.response_ids) for s in samples)
    out = torch.zeros(len(samples), width)
    with torch.no_grad():
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            p, n = len(s.prompt_ids), len(s.response_ids)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, p - 1 : p - 1 + n].float(), -1)
            out[i, :n] = logp.gather(-1, ids[0, p : p + n, None]).squeeze(-1)
    return out


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
def test_cuda_logprobs_step_sleep_wake(qwen3_path: str, groups, layer_spec: str) -> None:
    g = groups(2, 4, seed=31)
    expected = hf_logprobs(qwen3_path, g)
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
