"""The critic PPO trains beside the policy: its values, its gradient (micro-batched, shared
prompts or not, equal to one big batch of plain Hugging Face), learning, resume, sleep/wake."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions, PPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import FSDP2Trainer, build
from miles_trainer_common.batch import pack, token_batch
from torch.distributed.tensor import DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _critic(trainer: FSDP2Trainer) -> torch.nn.Module:
    assert trainer._local is not None and trainer._local.critic is not None
    return trainer._local.critic


def _critic_weights(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    return {n: _full(v) for n, v in _critic(trainer).state_dict().items()}


def _critic_grads(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad) for n, p in _critic(trainer).named_parameters()}


def hf_critic(path: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain Hugging Face value model (token classification, one label) holding ``weights``."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    model.eval()
    return model


def hf_values(model: torch.nn.Module, groups: list) -> torch.Tensor:
    """Reference values ``[B, T]``: one plain forward per sample, the value of response token
    ``j`` read at the position before it (the last prompt token for ``j = 0``)."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.response_ids) for s in samples)
    rows = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        out = model(input_ids=ids).logits[0, :, 0].float()
        p, n = len(s.prompt_ids), len(s.response_ids)
        rows.append(torch.nn.functional.pad(out[p - 1 : p - 1 + n], (0, width - n)))
    return torch.stack(rows)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_values_equal_a_plain_hf_value_model(llama_path: str, groups, share_prompts) -> None:
    g = groups(n_groups=3, group_size=3, seed=31)
    trainer = build(FSDP2Options(micro_batch_tokens=30, share_prompts=share_prompts, cpu_threads=1))
    trainer.setup(llama_path)
    values = trainer.compute_values(g)
    reference = hf_critic(llama_path, _critic_weights(trainer))
    with torch.no_grad():
        expected = hf_values(reference, g)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    assert values.abs().sum() > 0
    # The value head is new (the checkpoint is a causal LM), drawn from the seed alone: the
    # same for any trainer with that seed, and the body is the policy's checkpoint.
    again = build(FSDP2Options(cpu_threads=1))
    again.setup(llama_path)
    torch.manual_seed(999)  # the run's RNG does not decide the head
    again.compute_values(g)
    for name, w in _critic_weights(again).items():
        assert torch.equal(w, _critic_weights(trainer)[name]), name
    assert trainer.fingerprint()["critic"] == again.fingerprint()["critic"]


# PPO with a recomputed behaviour policy, a KL to the reference and an entropy bonus: the
# policy's and the critic's gradients both come from the one loss of the whole batch.
PPO = PPOOptions(behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01)
OPTS = dict(lr=1e-3, eps=1e-3, max_grad_norm=None, cpu_threads=1)


@pytest.mark.parametrize(("keep_activations", "share_prompts"), [(True, True), (False, False)])
def test_critic_gradient_equals_one_big_batch(
    llama_path: str, groups, hf, keep_activations: bool, share_prompts: bool
) -> None:
    """At three token budgets, the critic's gradient (and the policy's) is that of plain
    Hugging Face models with one full-batch backward of the same PPO loss."""
    g = groups(n_groups=3, group_size=4, seed=32)
    algo = build_policy_gradient(PPO)
    probe = build(FSDP2Options(cpu_threads=1))
    probe.setup(llama_path)
    probe.compute_values(g)
    initial_critic = _critic_weights(probe)

    policy = hf.model(llama_path)
    critic = hf_critic(llama_path, initial_critic)
    batch = token_batch(pack(g))
    lp, ent = hf.logprobs(policy, g)
    v = hf_values(critic, g)
    batch.old_logprobs = lp.detach().clone()
    batch.ref_logprobs = lp.detach().clone()
    batch.values = v.detach().clone()
    algo.compute_advantages(batch)
    loss, ref_metrics = algo.loss(batch, lp, entropy=ent, values=v)
    loss.backward()
    ref_policy = {n: p.grad.clone() for n, p in policy.named_parameters()}
    ref_critic = {n: p.grad.clone() for n, p in critic.named_parameters()}
    ref_norm = float(torch.nn.utils.clip_grad_norm_(critic.parameters(), float("inf")))
    assert ref_norm > 0 and ref_metrics["loss/value"] > 0

    splits = set()
    for budget in (10_000, 30, 1):
        trainer = build(
            FSDP2Options(
                micro_batch_tokens=budget,
                keep_activations=keep_activations,
                share_prompts=share_prompts,
                critic={"max_grad_norm": None},
                **OPTS,
            )
        )
        trainer.setup(llama_path)
        metrics = trainer.train_step(g, algo)
        splits.add(metrics["micro_batches"])
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        assert metrics["loss/value"] == pytest.approx(ref_metrics["loss/value"], abs=1e-6)
        assert metrics["critic/grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        grads = _critic_grads(trainer)
        assert grads.keys() == ref_critic.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_critic[name], atol=1e-6, rtol=1e-5, msg=name)
        assert trainer._local is not None and trainer._local.model is not None
        for name, p in trainer._local.model.named_parameters():
            torch.testing.assert_close(
                _full(p.grad), ref_policy[name], atol=1e-6, rtol=1e-5, msg=name
            )
    assert len(splits) >= 2  # the budgets really split the batch differently


def test_shared_and_unshared_prompts_give_the_same_critic_update(llama_path: str, groups) -> None:
    g = groups(n_groups=2, group_size=4, seed=33)
    algo = build_policy_gradient(PPO)
    after = []
    for share in (True, False):
        trainer = build(FSDP2Options(share_prompts=share, micro_batch_tokens=40, **OPTS))
        trainer.setup(llama_path)
        trainer.train_step(g, algo)
        after.append((_critic_weights(trainer), trainer.compute_values(g)))
    (w_shared, v_shared), (w_plain, v_plain) = after
    for name, w in w_shared.items():
        torch.testing.assert_close(w, w_plain[name], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(v_shared, v_plain, atol=1e-5, rtol=0)


def _on_policy(trainer: FSDP2Trainer, groups: list) -> None:
    lp, _ = trainer.compute_logprobs(groups)
    for i, s in enumerate(s for g in groups for s in g.samples):
        s.logprobs = [
            v * m for v, m in zip(lp[i, : len(s.response_ids)].tolist(), s.loss_mask, strict=True)
        ]


def _value_error(trainer: FSDP2Trainer, groups: list) -> float:
    """Mean squared error of the critic's values against the return, which with
    ``gamma = gae_lambda = 1`` is the sample's reward on every loss token."""
    batch = token_batch(pack(groups))
    m = batch.response_mask.float()
    err = (trainer.compute_values(groups) - batch.rewards[:, None]) ** 2
    return float((err * m).sum() / m.sum())


def _mean_logprob(lp: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> float:
    m = mask[rows]
    return float((lp[rows] * m).sum() / m.sum())


def test_ppo_improves_the_policy_and_the_critic(llama_path: str, groups) -> None:
    g = groups(n_groups=2, group_size=4, seed=34)
    trainer = build(
        FSDP2Options(lr=3e-3, micro_batch_tokens=40, cpu_threads=1, critic={"lr": 3e-3})
    )
    trainer.setup(llama_path)
    _on_policy(trainer, g)
    algo = build_policy_gradient(
        PPOOptions(behaviour_policy="recomputed", gamma=1.0, gae_lambda=1.0)
    )
    batch = token_batch(pack(g))
    good, bad = batch.rewards > 0, batch.rewards == 0
    before, _ = trainer.compute_logprobs(g)
    error_before = _value_error(trainer, g)
    rows = [trainer.train_step(g, algo) for _ in range(4)]
    after, _ = trainer.compute_logprobs(g)
    error_after = _value_error(trainer, g)
    mask = batch.response_mask.float()
    assert _mean_logprob(after, mask, good) > _mean_logprob(before, mask, good) + 0.05
    assert _mean_logprob(after, mask, bad) < _mean_logprob(before, mask, bad) - 0.05
    # Measured: 0.66 -> 0.18 (a critic that is not trained keeps its error exactly: the
    # policy's steps do not touch it).
    assert error_after < 0.5 * error_before
    assert rows[-1]["loss/value"] < rows[0]["loss/value"]
    assert rows[-1]["explained_variance"] > rows[0]["explained_variance"]
    for row in rows:
        assert row["critic/lr"] == row["lr"] == 3e-3 and row["critic/grad_norm"] > 0
        assert row["critic/skipped_nonfinite"] == 0.0


def test_no_critic_without_values(llama_path: str, groups) -> None:
    trainer = build(FSDP2Options(cpu_threads=1))
    trainer.setup(llama_path)
    metrics = trainer.train_step(groups(seed=35), build_policy_gradient(GRPOOptions()))
    assert trainer._local is not None and trainer._local.critic is None
    assert not any(k.startswith("critic/") for k in metrics)
    assert set(trainer.fingerprint()) == {"weights", "optimizer"}


CKPT = FSDP2Options(
    lr=5e-3,
    weight_decay=0.1,
    warmup_steps=1,
    lr_schedule="cosine",
    decay_steps=6,
    min_lr_ratio=0.1,
    micro_batch_tokens=30,
    cpu_threads=1,
    critic={"lr": 1e-2, "warmup_steps": 2},
)


def test_resume_with_the_critic_is_bitwise(llama_path: str, groups, tmp_path) -> None:
    g = groups(seed=36)
    algo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed", kl_coef=0.05))
    first = build(CKPT)
    first.setup(llama_path)
    first.train_step(g, algo)
    first.train_step(g, algo)
    saved = first.fingerprint()
    ckpt = str(tmp_path / "ckpt")
    first.save(ckpt, extra={"position": 3})
    third = first.train_step(g, algo)
    expected = first.fingerprint()
    assert expected["critic"] != saved["critic"]  # the third step trained the critic

    resumed = build(CKPT)
    resumed.setup(llama_path)
    resumed.load(ckpt)
    assert resumed.fingerprint() == saved
    again = resumed.train_step(g, algo)
    assert resumed.fingerprint() == expected
    for key in ("loss", "loss/value", "critic/grad_norm", "critic/lr", "explained_variance"):
        assert again[key] == third[key], key


def test_resume_from_before_the_critic_existed(llama_path: str, groups, tmp_path) -> None:
    """A checkpoint without a critic: the resumed trainer builds it at its first PPO step, as
    the saved one does, and one with a critic already built drops it on that load."""
    g = groups(seed=37)
    grpo = build_policy_gradient(GRPOOptions())
    ppo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed"))
    first = build(CKPT)
    first.setup(llama_path)
    first.train_step(g, grpo)
    ckpt = str(tmp_path / "ckpt")
    first.save(ckpt)
    first.train_step(g, ppo)
    resumed = build(CKPT)
    resumed.setup(llama_path)
    resumed.compute_values(g)  # a critic before the load
    resumed.load(ckpt)
    resumed.train_step(g, ppo)
    assert resumed.fingerprint() == first.fingerprint()


def test_sleep_wake_with_the_critic(llama_path: str, groups) -> None:
    g = groups(seed=38)
    algo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed"))
    slept = build(FSDP2Options(lr=1e-2, cpu_threads=1))
    slept.setup(llama_path)
    straight = build(FSDP2Options(lr=1e-2, cpu_threads=1))
    straight.setup(llama_path)
    slept.train_step(g, algo)
    straight.train_step(g, algo)
    before = slept.fingerprint()
    slept.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        slept.compute_values(g)
    slept.wake()
    assert slept.fingerprint() == before
    slept.train_step(g, algo)
    straight.train_step(g, algo)
    assert slept.fingerprint() == straight.fingerprint()


def test_export_weights_is_the_policy_only(llama_path: str, groups, hf) -> None:
    trainer = build(FSDP2Options(cpu_threads=1))
    trainer.setup(llama_path)
    trainer.train_step(groups(seed=39), build_policy_gradient(PPOOptions()))
    names = [n for n, _ in trainer.export_weights()]
    assert names == list(hf.model(llama_path).state_dict())
