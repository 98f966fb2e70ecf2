"""Rollout routing replay over multi-turn sessions, on a live engine serving a tiny Qwen3-MoE:
each turn's request asks the engine for its routing record (as a run with ``rollout.routing``
does), the session joins the turns' records into one per sample (every position of prompt,
tool results and replies), and the FSDP2 trainer routes by it: the trainer's own choice agrees
with the joined record where nothing was replayed, the replay agrees with it exactly, and the
replayed log-probs are the engine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory, script_model: Any) -> Path:
    """The scripted Qwen3-MoE with small random attention and expert outputs added back and its
    routers sharpened: the script still decides the tokens, while the experts each position is
    routed to (and so its log-prob) depend on the whole context."""
    return script_model(tmp_path_factory.mktemp("script-moe"), moe=True, mix=7)


@pytest.fixture(scope="module")
def moe_engine(moe_model: Path, sessions_support: Any) -> Iterator[str]:
    with sessions_support.engine(moe_model, num_threads=1) as url:
        yield url


@pytest.mark.slow
def test_multi_turn_samples_carry_the_routing_and_replay_it(
    moe_model: Path,
    moe_engine: str,
    family: Any,
    loop_thread: Any,
    tools: Any,
    sessions_support: Any,
) -> None:
    import torch
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build as build_trainer
    from miles_trainer_common.batch import pack

    groups = sessions_support.rollouts(moe_engine, family, tools, loop_thread, routed=True)
    samples = [s for g in groups for s in g.samples]
    assert max(len(s.metadata["turns"]) for s in samples) >= 2
    for s in samples:
        record = s.routed_experts
        assert record is not None, s.metadata
        assert record.positions == len(s.prompt_ids) + len(s.response_ids) - 1
        flat = record.ids().tolist()
        assert record.width == 2 * 2  # 2 layers x top-2
        assert min(flat) >= 0 and max(flat) < 4  # every layer is an MoE layer

    packed = pack(groups)
    mask = packed.response_mask.bool()
    pg = build_policy_gradient(GRPOOptions())
    options = FSDP2Options(lr=1e-3, cpu_threads=1, micro_batch_tokens=160)
    # Unreplayed, the trainer routes by its own top-k: in float32 on both sides it chooses
    # what the joined record says, position by position; a record misplaced by a turn would not.
    with build_trainer(options, routing="record") as trainer:
        trainer.setup(str(moe_model))
        own = trainer.train_step(groups, pg)
    assert own["routing/expert_agreement"] >= 0.99, own
    with build_trainer(options, routing="replay") as trainer:
        trainer.setup(str(moe_model))
        lp, _ = trainer.compute_logprobs(groups)
        replayed = trainer.train_step(groups, pg)
    assert replayed["routing/expert_agreement"] == 1.0
    assert replayed["routing/bytes_per_token"] > 0
    gap = (lp - packed.rollout_logprobs).abs()[mask]
    assert gap.numel() > 0 and float(gap.max()) < 1e-4, float(gap.max())
    assert all(torch.isfinite(torch.tensor(float(v))) for v in replayed.values())
