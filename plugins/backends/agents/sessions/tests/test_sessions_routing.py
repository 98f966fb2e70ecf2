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
    """The scripted Qwen3-MoE with small random attention and expert outputs added back: the
    script still decides the tokens, while the experts each position is routed to (and so its
    log-prob) depend on the whole context."""
    import torch
    from transformers import AutoModelForCausalLM

    path = script_model(tmp_path_factory.mktemp("script-moe"), moe=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.experts.down_proj):
                w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
            gate = layer.mlp.gate.weight
            gate.copy_(torch.randn(gate.shape, generator=gen) * 2.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_engine(moe_model: Path) -> Iterator[str]:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=3, context_length=2048, num_threads=1, startup_timeout_s=180
        )
    )
    url = launcher.launch(str(moe_model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


@pytest.mark.slow
def test_multi_turn_samples_carry_the_routing_and_replay_it(
    moe_model: Path, moe_engine: str, family: Any, loop_thread: Any, tools: Any
) -> None:
    import torch
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build as build_trainer
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions
    from miles_sessions.rollout import build as build_rollout
    from miles_trainer_common.batch import pack

    from miles_core.runtime.fleet import RoutedRequests

    rollout = build_rollout(SessionRolloutOptions(max_turns=4, max_new_tokens=24))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
    }

    async def go() -> Any:
        async with EngineClient(moe_engine, timeout_s=120) as client:
            try:
                return [
                    await rollout(
                        prompt,
                        group_size=3,
                        engine=RoutedRequests(client),
                        reward=lambda s, p: float(len(s.metadata["turns"])),
                        family=family,
                        step=1,
                    )
                    for _ in range(2)
                ]
            finally:
                await rollout.close()

    groups = loop_thread.run(go(), timeout=300)
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
