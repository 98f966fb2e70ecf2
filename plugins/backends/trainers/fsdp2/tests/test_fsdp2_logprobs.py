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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_true_on_policy_shares_whole_prompt_tiles_bitwise(family: str, request, groups, hf) -> None:
    """True on-policy mode: prompts longer than a key tile are shared tile by tile (each
    response with its own copy of the prompt's last partial tile), and the log-probs are bitwise
    one plain forward per sample in the mode, in one micro-batch or several."""
    from miles_trainer_common.layout import shared_layout

    from miles_core.invariant.kernels import TILE, invariant_mode

    path = request.getfixturevalue(f"{family}_path")
    g = groups(n_groups=3, group_size=3, seed=11)
    for i, group in enumerate(g):  # prompts of one tile and a half, two, and almost three
        length = (TILE + 6, 2 * TILE, 3 * TILE - 1)[i]
        prompt = [(7 * j + i) % 60 + 1 for j in range(length)]
        for s in group.samples:
            s.prompt_ids = list(prompt)
    packed = pack(g)
    rows = list(range(packed.size))
    layout = shared_layout(packed, rows, TILE)
    assert layout.ids.numel() < packed.size * int(packed.seq_lens.max())  # really shared
    with torch.no_grad(), invariant_mode():
        model = hf.model(path)
        ref = []
        for s in (s for group in g for s in group.samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            p, n = len(s.prompt_ids), len(s.response_ids)
            lp = logp[p - 1 : p - 1 + n].gather(-1, ids[0, p : p + n, None]).squeeze(-1)
            ref.append(torch.nn.functional.pad(lp, (0, packed.width - n)))
    for budget in (10_000, 300):
        trainer = build(FSDP2Options(micro_batch_tokens=budget, cpu_threads=1), true_on_policy=True)
        trainer.setup(path)
        lp, _ = trainer.compute_logprobs(g)
        trainer.close()
        mask = packed.response_mask > 0
        assert torch.equal(lp[mask], torch.stack(ref)[mask]), budget
