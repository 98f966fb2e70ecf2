"""Megatron's distributed optimizer (``backend.distributed_optimizer: true``) on gloo: the same
update as the plain AdamW path, its state sharded over the replicas, save/resume bit for bit,
and the combinations it refuses."""

from __future__ import annotations

import pytest
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build
from miles_trainer_common.processes import WorkerError

# As test_megatron_train's parity: a recomputed behaviour policy, KL to a reference, an entropy
# bonus, micro-batches, clipping binding.
ALGO = GRPOOptions(
    behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean"
)
OPTS = dict(
    lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, micro_batch_tokens=40, cpu_threads=1
)


def _two_steps(options: MegatronOptions, path: str, groups: list) -> tuple[list, dict, list]:
    """Two steps (each its own batch): the metrics, the exported weights, each rank's count of
    optimizer-state elements."""
    algo = build_policy_gradient(ALGO)
    with build(options) as trainer:
        trainer.setup(path)
        metrics = [trainer.train_step(g, algo) for g in groups]
        weights = dict(trainer.export_weights())
        elements = trainer._workers.call("optimizer_state_elements")
    return metrics, weights, elements


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp", "dp"), [("qwen3", 1, 1, 2), ("llama", 1, 2, 2), ("qwen3", 2, 1, 1)]
)
def test_same_update_as_adamw_and_sharded_state(
    family: str, tp: int, pp: int, dp: int, request, groups
) -> None:
    """Two replicas (and, for the tied Llama, two pipeline stages: the embedding's two copies
    counted once in the norm), or two tensor-parallel ranks (each rank's part of a split weight
    counted in the norm, a whole one once, QK-norm gradients summed in Megatron's buffers): two
    steps give the AdamW path's loss, grad norm and weights, and each replica holds its share
    of the optimizer state."""
    path = request.getfixturevalue(f"{family}_path")
    batches = [groups(2, 4, seed=1), groups(2, 4, seed=5)]
    base = dict(OPTS, tensor_parallel=tp, data_parallel=dp, pipeline_parallel=pp)
    m_ref, w_ref, e_ref = _two_steps(MegatronOptions(**base), path, batches)
    m, w, e = _two_steps(MegatronOptions(**base, distributed_optimizer=True), path, batches)
    for step, ref in zip(m, m_ref, strict=True):
        assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert step["lr"] == ref["lr"] and not step["skipped_nonfinite"]
    assert list(w) == list(w_ref)
    worst = 0.0
    for name, ref in w_ref.items():
        rel = float((w[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        worst = max(worst, rel)
        assert rel < 1e-5, (name, rel)
    print(f"worst relative weight difference vs AdamW: {worst:.2e}")
    assert len(e) == len(e_ref) == tp * pp * dp
    if dp == 1:  # one replica: its shard is its whole part (the buffer padded a little)
        for n, full in zip(e, e_ref, strict=True):
            assert n == pytest.approx(full, rel=0.02)
        return
    # AdamW: two moments of every parameter on every rank; sharded: each replica holds its
    # half (the buffer is padded to a multiple of the replica count).
    for stage in range(pp):
        replicas = e[2 * stage : 2 * stage + 2]
        assert e_ref[2 * stage] == e_ref[2 * stage + 1]
        full = e_ref[2 * stage]
        assert sum(replicas) == pytest.approx(full, rel=0.02)
        for n in replicas:
            assert n == pytest.approx(full / 2, rel=0.05)


@pytest.mark.slow
def test_save_resume_is_bitwise(qwen3_path: str, groups, tmp_path, resume_is_bitwise) -> None:
    """Save after a step, two ranks; a new trainer resumes from it; the next step is bitwise."""
    g = groups(2, 4, seed=2)
    algo = build_policy_gradient(GRPOOptions())
    options = MegatronOptions(lr=1e-3, cpu_threads=1, data_parallel=2, distributed_optimizer=True)
    resume_is_bitwise(options, qwen3_path, g, algo, tmp_path)
    plain = MegatronOptions(lr=1e-3, cpu_threads=1, data_parallel=2)
    with build(plain) as third:
        third.setup(qwen3_path)
        # the rank's ValueError, reported by the controller
        with pytest.raises(WorkerError, match=r"backend\.distributed_optimizer=true"):
            third.load(str(tmp_path / "ckpt"))


def test_one_rank_equals_adamw(qwen3_path: str, groups) -> None:
    """In-process (one rank: the shard is the whole model): the same step as AdamW."""
    g = groups(2, 4, seed=1)
    algo = build_policy_gradient(ALGO)
    out = []
    for sharded in (False, True):
        trainer = build(MegatronOptions(**OPTS, distributed_optimizer=sharded))
        trainer.setup(qwen3_path)
        metrics = trainer.train_step(g, algo)
        out.append((metrics, dict(trainer.export_weights())))
        trainer.close()
    (m_ref, w_ref), (m, w) = out
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    for name, ref in w_ref.items():
        rel = float((w[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert rel < 1e-5, (name, rel)


def test_refusals(qwen3_path: str) -> None:
    """A bad value names the field; an adapter is refused before any process starts."""
    from miles_lora.adapter import build as build_lora
    from miles_lora.options import LoraOptions
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="distributed_optimizer"):
        MegatronOptions(distributed_optimizer="sometimes")
    adapter = build_lora(LoraOptions(rank=4))
    with pytest.raises(ValueError, match=r"backend\.distributed_optimizer: .*adapter"):
        build(MegatronOptions(distributed_optimizer=True), adapter=adapter)
