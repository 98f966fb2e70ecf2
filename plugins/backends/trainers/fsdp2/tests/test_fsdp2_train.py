"""Training steps: GRPO learns, micro-batching equals one big batch, export, sleep/wake."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import FSDP2Trainer, build
from miles_trainer_common.batch import pack, token_batch
from torch.distributed.tensor import DTensor


def _on_policy(trainer: FSDP2Trainer, groups: list) -> None:
    """Stamp the trainer's own log-probs on the samples, as an engine with equal weights would."""
    lp, _ = trainer.compute_logprobs(groups)
    for i, s in enumerate(s for g in groups for s in g.samples):
        s.logprobs = [
            v * m for v, m in zip(lp[i, : len(s.response_ids)].tolist(), s.loss_mask, strict=True)
        ]


def _mean_logprob(lp: torch.Tensor, batch, rows: torch.Tensor) -> float:
    m = batch.response_mask[rows]
    return float((lp[rows] * m).sum() / m.sum())


def test_grpo_raises_logprobs_of_positive_samples(llama_path: str, groups) -> None:
    groups = groups(n_groups=2, group_size=4, seed=1)
    trainer = build(FSDP2Options(lr=3e-3, micro_batch_tokens=40, cpu_threads=1))
    trainer.setup(llama_path)
    _on_policy(trainer, groups)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed"))
    batch = token_batch(pack(groups))
    algo.compute_advantages(batch)
    positive = batch.advantages[:, 0] > 0
    negative = batch.advantages[:, 0] < 0
    assert positive.any() and negative.any()
    before, _ = trainer.compute_logprobs(groups)
    for step in range(3):
        metrics = trainer.train_step(groups, algo)
        assert trainer.weight_version == step + 1 == metrics["weight_version"]
    after, _ = trainer.compute_logprobs(groups)
    assert _mean_logprob(after, batch, positive) > _mean_logprob(before, batch, positive) + 0.05
    assert _mean_logprob(after, batch, negative) < _mean_logprob(before, batch, negative) - 0.05
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "clip_fraction", "approx_kl"):
        assert key in metrics and metrics[key] == metrics[key]  # present, not NaN
    assert metrics["lr"] == 3e-3 and metrics["grad_norm"] > 0 and metrics["tokens_per_s"] > 0


def _grads(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    assert trainer._local is not None and trainer._local.model is not None
    out = {}
    for name, p in trainer._local.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out


# GRPO with a recomputed behaviour policy, a KL to the reference (a second, frozen model), an
# entropy bonus (gradient through the entropies too) and the sequence-mean aggregation, whose
# per-micro-batch share is not proportional to its token count.
ALGO = GRPOOptions(
    behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean"
)
# eps = 1e-3: GRPO's zero-mean advantages make some gradients nearly cancel, and Adam's first
# step g / (|g| + eps) would amplify their round-off; with this eps the update stays a smooth
# function of the gradient, so equal gradients give weights equal to ~1e-7.
OPTS = dict(lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, cpu_threads=1)


@pytest.mark.parametrize(("keep_activations", "share_prompts"), [(True, True), (False, False)])
def test_micro_batches_equal_one_big_batch(
    llama_path: str, groups, hf, keep_activations: bool, share_prompts: bool
) -> None:
    """Both ways of taking the step (one forward kept for the backward, each group's prompt
    computed once; or a no-grad forward then forward + backward per micro-batch, one sequence
    per sample) give plain Hugging Face's one-batch gradient."""
    groups = groups(n_groups=3, group_size=4, seed=2)
    algo = build_policy_gradient(ALGO)

    # The reference: plain Hugging Face, one forward with grad over the whole batch.
    model = hf.model(llama_path)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01, betas=(0.9, 0.999)
    )
    batch = token_batch(pack(groups))
    lp, ent = hf.logprobs(model, groups)
    batch.old_logprobs = lp.detach().clone()
    batch.ref_logprobs = lp.detach().clone()  # the reference model is the initial policy
    algo.compute_advantages(batch)
    loss, ref_metrics = algo.loss(batch, lp, entropy=ent)
    loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
    assert ref_norm > 0.5  # clipping is active
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    ref_weights = model.state_dict()

    seq_lens = pack(groups).seq_lens.tolist()
    splits = set()
    for budget in (10_000, 30, 1):
        trainer = build(
            FSDP2Options(
                micro_batch_tokens=budget,
                keep_activations=keep_activations,
                share_prompts=share_prompts,
                **OPTS,
            )
        )
        trainer.setup(llama_path)
        metrics = trainer.train_step(groups, algo)
        splits.add(metrics["micro_batches"])
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        grads = _grads(trainer)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
        exported = dict(trainer.export_weights())
        assert exported.keys() == ref_weights.keys()
        for name, w in exported.items():
            torch.testing.assert_close(w, ref_weights[name], atol=1e-6, rtol=0, msg=name)
    if share_prompts:
        # Micro-batches hold whole groups: the whole batch, or one group each.
        assert splits == {1.0, float(len(groups))}
    else:
        # Three different splits: the whole batch, a few samples each, one sample each.
        assert len(splits) == 3 and {1.0, float(len(seq_lens))} <= splits


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_export_weights_is_the_hf_state_dict(family: str, request, groups, hf) -> None:
    path = request.getfixturevalue(f"{family}_path")
    reference = hf.model(path)
    expected = reference.state_dict()
    trainer = build(FSDP2Options(lr=1e-2, cpu_threads=1))
    trainer.setup(path)
    stream = trainer.export_weights()
    first_name, first = next(stream)  # a stream, one tensor at a time
    assert first_name == next(iter(expected))
    exported = {first_name: first, **dict(stream)}
    # a tied head is the embedding: exported once, under the embedding's name
    tied = ["lm_head.weight"] if reference.config.tie_word_embeddings else []
    assert list(exported) == [n for n in expected if n not in tied]
    for name, tensor in exported.items():
        assert not isinstance(tensor, DTensor)
        assert tensor.shape == expected[name].shape and tensor.dtype == expected[name].dtype
        assert torch.equal(tensor, expected[name]), name
    # After a step the exported weights are the trained ones: a fresh HF model loaded with
    # them computes the trainer's log-probs.
    g = groups(seed=5)
    trainer.train_step(g, build_policy_gradient(GRPOOptions()))
    after = dict(trainer.export_weights())
    assert any(not torch.equal(after[n], expected[n]) for n in after)
    # the head of a tied model loads with the embedding (one parameter)
    assert reference.load_state_dict(after, strict=False).missing_keys == tied
    with torch.no_grad():
        ref_lp, _ = hf.logprobs(reference, g)
    lp, _ = trainer.compute_logprobs(g)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)


def test_export_dtype_bf16(llama_path: str) -> None:
    trainer = build(FSDP2Options(export_dtype="bf16", cpu_threads=1))
    trainer.setup(llama_path)
    assert {t.dtype for _, t in trainer.export_weights()} == {torch.bfloat16}


def test_sleep_wake_restores_exactly(llama_path: str, groups) -> None:
    g = groups(seed=4)
    algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed"))
    slept = build(FSDP2Options(lr=1e-2, cpu_threads=1))
    slept.setup(llama_path)
    straight = build(FSDP2Options(lr=1e-2, cpu_threads=1))
    straight.setup(llama_path)
    slept.train_step(g, algo)
    straight.train_step(g, algo)
    before = slept.fingerprint()
    slept.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        slept.train_step(g, algo)
    slept.wake()
    assert slept.fingerprint() == before
    slept.train_step(g, algo)
    straight.train_step(g, algo)
    assert slept.fingerprint() == straight.fingerprint()


def test_lr_schedule_in_metrics(llama_path: str, groups) -> None:
    g = groups(seed=6)
    trainer = build(
        FSDP2Options(lr=1e-3, warmup_steps=2, lr_schedule="cosine", decay_steps=4, cpu_threads=1)
    )
    trainer.setup(llama_path)
    algo = build_policy_gradient(GRPOOptions())
    lrs = [trainer.train_step(g, algo)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4, 0.0], abs=1e-12)


def test_missing_reward_is_refused(llama_path: str, groups) -> None:
    g = groups(seed=8)
    g[0].samples[2].reward = None
    trainer = build(FSDP2Options(cpu_threads=1))
    trainer.setup(llama_path)
    with pytest.raises(ValueError, match=r"samples \[2\] have no reward"):
        trainer.train_step(g, build_policy_gradient(GRPOOptions()))
    assert trainer.weight_version == 0
