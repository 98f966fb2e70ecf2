"""The trainer contract on Megatron: parity with FSDP2 on the same weights (log-probs and one
train step, tensor parallel 1 and 2), bitwise save/resume, sleep/wake, the weight stream."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build as build_fsdp2
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build

# GRPO with a recomputed behaviour policy, a KL to a frozen reference, an entropy bonus
# (gradient through the entropies) and the sequence-mean aggregation, on micro-batches.
ALGO = GRPOOptions(
    behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean"
)
# eps = 1e-3 keeps Adam's first step a smooth function of the gradient (see the FSDP2 tests).
OPTS = dict(lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, micro_batch_tokens=40)


@pytest.fixture(scope="module")
def fsdp2_reference(request: pytest.FixtureRequest) -> object:
    """FSDP2's log-probs, loss, grad norm and exported weights after one step, per family."""
    cache: dict[str, tuple] = {}

    def get(path: str, groups: list) -> tuple:
        if path not in cache:
            trainer = build_fsdp2(FSDP2Options(**OPTS, cpu_threads=1, share_prompts=False))
            trainer.setup(path)
            lp, ent = trainer.compute_logprobs(groups)
            metrics = trainer.train_step(groups, build_policy_gradient(ALGO))
            weights = dict(trainer.export_weights())
            trainer.close()
            cache[path] = (lp, ent, metrics, weights)
        return cache[path]

    return get


def _check_parity(trainer: object, path: str, groups: list, reference: object) -> None:
    lp_ref, ent_ref, m_ref, w_ref = reference(path, groups)
    lp, ent = trainer.compute_logprobs(groups)
    assert (lp - lp_ref).abs().max() < 1e-5
    assert (ent - ent_ref).abs().max() < 1e-5
    metrics = trainer.train_step(groups, build_policy_gradient(ALGO))
    assert metrics["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    weights = dict(trainer.export_weights())
    assert list(weights) == list(w_ref)
    for name, ref in w_ref.items():
        rel = (weights[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert rel < 1e-5, (name, float(rel))


def test_parity_with_fsdp2_tp1(model_path: str, groups, fsdp2_reference) -> None:
    g = groups(2, 4, seed=1)
    trainer = build(MegatronOptions(**OPTS, cpu_threads=1))
    trainer.setup(model_path)
    _check_parity(trainer, model_path, g, fsdp2_reference)
    assert trainer.weight_version == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp", "dp", "keep"),
    [
        ("qwen3", 2, 1, 1, True),  # QK-norm weights whole on both ranks, heads split
        ("llama", 1, 2, 1, True),  # tied embedding kept as two copies on two stages
        ("llama", 2, 2, 1, True),
        ("qwen3", 1, 2, 2, False),  # two replicas of a two-stage pipeline, recomputed forward
    ],
)
def test_parity_with_fsdp2_parallel(
    family: str, tp: int, pp: int, dp: int, keep: bool, request, groups, fsdp2_reference
) -> None:
    """Tensor, pipeline and data parallel on gloo (spawned processes) against FSDP2."""
    path = request.getfixturevalue(f"{family}_path")
    g = groups(2, 4, seed=1)
    options = MegatronOptions(
        **OPTS,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        keep_activations=keep,
        cpu_threads=1,
    )
    with build(options) as trainer:
        trainer.setup(path)
        _check_parity(trainer, path, g, fsdp2_reference)


def test_save_resume_is_bitwise(llama_path: str, groups, tmp_path) -> None:
    g = groups(2, 4, seed=2)
    algo = build_policy_gradient(GRPOOptions())
    first = build(MegatronOptions(lr=1e-3, cpu_threads=1))
    first.setup(llama_path)
    first.train_step(g, algo)
    first.save(str(tmp_path / "ckpt"), extra={"data": 7})
    first.train_step(g, algo)
    expected = first.fingerprint()
    second = build(MegatronOptions(lr=1e-3, cpu_threads=1))
    second.setup(llama_path)
    second.load(str(tmp_path / "ckpt"))
    assert second.extra == {"data": 7} and second.weight_version == 1
    second.train_step(g, algo)
    assert second.fingerprint() == expected
    with pytest.raises(FileNotFoundError, match="no megatron checkpoint"):
        second.load(str(tmp_path))


def test_sleep_wake_and_the_weight_stream(llama_path: str, groups) -> None:
    g = groups(1, 4, seed=3)
    trainer = build(MegatronOptions(lr=1e-3, cpu_threads=1, export_dtype="bf16"))
    trainer.setup(llama_path)
    before = trainer.fingerprint()
    trainer.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        trainer.compute_logprobs(g)
    trainer.wake()
    assert trainer.fingerprint() == before
    stream = trainer.export_weights()
    name, first = next(stream)
    assert name == "model.embed_tokens.weight" and first.dtype == torch.bfloat16
    rest = dict(stream)
    assert "lm_head.weight" not in rest  # the tied head is the embedding, sent once
