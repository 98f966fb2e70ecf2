"""compute_logprobs equals a plain Hugging Face forward, whatever the micro-batch split."""

from __future__ import annotations

import pytest
import torch
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build
from miles_trainer_common.batch import pack


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("budget", "share"), [(10_000, True), (24, True), (24, False)])
def test_logprobs_equal_plain_hf_forward(
    family: str, budget: int, share: bool, request, groups, hf
) -> None:
    """One sequence per sample or one per group (the prompt once, then every response under a
    block mask), in one micro-batch or many: the log-probs of a plain per-sample forward."""
    path = request.getfixturevalue(f"{family}_path")
    groups = groups(n_groups=3, group_size=3, seed=7)
    # A group whose samples do not all share the prompt: two sequences for that group.
    groups[1].samples[2].prompt_ids = [*groups[1].samples[2].prompt_ids, 5]
    trainer = build(FSDP2Options(micro_batch_tokens=budget, share_prompts=share, cpu_threads=1))
    trainer.setup(path)
    lp, ent = trainer.compute_logprobs(groups)
    with torch.no_grad():
        ref_lp, ref_ent = hf.logprobs(hf.model(path), groups)
    assert lp.shape == ref_lp.shape == (9, pack(groups).width)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert ent is not None
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    # Padding is 0 and every response token got a (negative) log-prob.
    for i, s in enumerate(s for g in groups for s in g.samples):
        n = len(s.response_ids)
        assert (lp[i, :n] < 0).all() and (lp[i, n:] == 0).all()


def test_bf16_mixed_precision_runs_close_to_fp32(llama_path: str, groups) -> None:
    groups = groups(seed=3)
    fp32 = build(FSDP2Options(cpu_threads=1))
    fp32.setup(llama_path)
    bf16 = build(FSDP2Options(precision="bf16", cpu_threads=1))
    bf16.setup(llama_path)
    lp32, _ = fp32.compute_logprobs(groups)
    lp16, _ = bf16.compute_logprobs(groups)
    assert lp16.dtype == torch.float32
    assert not torch.equal(lp16, lp32)  # bf16 compute really ran
    torch.testing.assert_close(lp16, lp32, atol=0.1, rtol=0)


def test_bf16_train_step_keeps_fp32_master_weights(llama_path: str, groups) -> None:
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions

    g = groups(seed=9)
    trainer = build(FSDP2Options(precision="bf16", lr=1e-2, micro_batch_tokens=30, cpu_threads=1))
    trainer.setup(llama_path)
    before = dict(trainer.export_weights())
    metrics = trainer.train_step(g, build_policy_gradient(GRPOOptions()))
    assert metrics["grad_norm"] > 0 and metrics["skipped_nonfinite"] == 0
    after = dict(trainer.export_weights())
    assert {t.dtype for t in after.values()} == {torch.float32}
    assert any(not torch.equal(after[n], before[n]) for n in before)
