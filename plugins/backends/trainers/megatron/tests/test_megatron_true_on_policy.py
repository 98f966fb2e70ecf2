"""True on-policy mode on Megatron: the trainer's log-probs are bitwise those of the Hugging
Face forward the embedded engine runs in :func:`miles_core.invariant.kernels.invariant_mode`
(whose KV-cache decode equals it bitwise: ``tests/test_invariant_kernels.py``), over
micro-batches of several sizes, in one process and over two pipeline stages; a step whose
rollout log-probs differ in one token fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build

from miles_core.data import Group, Sample


def with_logprobs(groups: list[Group], logprobs: list[list[float]]) -> list[Group]:
    """The groups with each sample's trained tokens carrying ``logprobs`` (0 where masked)."""
    rows = iter(logprobs)
    out = []
    for g in groups:
        samples = []
        for s in g.samples:
            lp = next(rows)
            kept = [x if m else 0.0 for x, m in zip(lp, s.loss_mask, strict=True)]
            samples.append(Sample(**{**vars(s), "logprobs": kept}))
        out.append(Group(samples=samples, prompt=g.prompt))
    return out


def _check(path: str, groups: list[Group], options: MegatronOptions, engine_logprobs: Any) -> None:
    expected = engine_logprobs(path, groups)
    trainer = build(options, true_on_policy=True)
    try:
        trainer.setup(path)
        lp, _ = trainer.compute_logprobs(groups)
        for i, row in enumerate(expected):
            assert lp[i, : len(row)].tolist() == row, f"sample {i}"
        algo = build_policy_gradient(GRPOOptions(behaviour_policy="recomputed"))
        on = with_logprobs(groups, expected)
        assert trainer.train_step(on, algo)["skipped_nonfinite"] == 0
        lp_after, _ = trainer.compute_logprobs(groups)
        assert not torch.equal(lp_after, lp)  # the step moved the weights
        trained = next(i for i, m in enumerate(on[0].samples[0].loss_mask) if m)
        off = with_logprobs(groups, engine_logprobs_after(trainer, groups))
        off[0].samples[0].logprobs[trained] += 1e-6
        with pytest.raises(Exception, match="differ"):
            trainer.train_step(off, algo)
    finally:
        trainer.close()


def engine_logprobs_after(trainer, groups: list[Group]) -> list[list[float]]:
    """The trainer's own current log-probs per sample (bitwise the engine's at its weights)."""
    lp, _ = trainer.compute_logprobs(groups)
    return [
        lp[i, : len(s.response_ids)].tolist()
        for i, s in enumerate(s for g in groups for s in g.samples)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bitwise_the_engines_in_micro_batches(arch: str, request, groups, engine_logprobs) -> None:
    """Tied embeddings (Llama) and query/key norms (Qwen3), in one process, the batch split in
    micro-batches of a few samples each."""
    path = request.getfixturevalue(f"{arch}_path")
    plain = build(MegatronOptions(cpu_threads=1))  # Megatron's own modules: not bitwise
    try:
        plain.setup(path)
        lp, _ = plain.compute_logprobs(groups(3, 4, seed=7))
        expected = engine_logprobs(path, groups(3, 4, seed=7))
        assert any(lp[i, : len(r)].tolist() != r for i, r in enumerate(expected))
    finally:
        plain.close()
    options = MegatronOptions(lr=1e-2, micro_batch_tokens=40, cpu_threads=1)
    _check(path, groups(3, 4, seed=7), options, engine_logprobs)


def test_bitwise_the_engines_over_two_pipeline_stages(
    llama_path: str, groups, engine_logprobs
) -> None:
    """Two stages in spawned processes (the tied embedding on both)."""
    _check(
        llama_path,
        groups(2, 4, seed=8),
        MegatronOptions(lr=1e-2, pipeline_parallel=2, micro_batch_tokens=40, cpu_threads=1),
        engine_logprobs,
    )


def test_refusals() -> None:
    with pytest.raises(ValueError, match="tensor_parallel must be 1"):
        build(MegatronOptions(tensor_parallel=2), true_on_policy=True)
    with pytest.raises(ValueError, match="transformer_engine"):
        build(MegatronOptions(layer_spec="transformer_engine"), true_on_policy=True)
