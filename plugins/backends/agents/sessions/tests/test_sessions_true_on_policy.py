"""True on-policy mode over multi-turn sessions: the session rollout's samples (several engine
turns, the tool results between them masked) carry log-probs that the FSDP2 trainer in the same
mode recomputes bitwise, although each turn's first token came from a prefill of the whole
conversation so far and the rest from decode steps batched with other sessions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def mixing_model(tmp_path_factory: pytest.TempPathFactory, script_model: Any) -> Path:
    """The scripted model, with small random attention and MLP outputs added back: the script
    still decides the tokens, but every log-prob now depends on the whole context."""
    import torch
    from transformers import AutoModelForCausalLM

    path = script_model(tmp_path_factory.mktemp("script-mixing"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def top_engine(mixing_model: Path) -> Iterator[str]:
    """A live embedded engine in true on-policy mode, batching up to 3 sessions' requests."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(max_running_requests=3, context_length=2048, startup_timeout_s=180),
        true_on_policy=True,
    )
    url = launcher.launch(str(mixing_model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


@pytest.mark.slow
def test_multi_turn_session_samples_are_recomputed_bitwise(
    mixing_model: Path, top_engine: str, family: Any, loop_thread: Any, tools: Any
) -> None:
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build as build_trainer
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions
    from miles_sessions.rollout import build as build_rollout
    from miles_trainer_common.batch import pack
    from miles_trainer_common.logprobs import check_on_policy

    rollout = build_rollout(SessionRolloutOptions(max_turns=4, max_new_tokens=24))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
    }

    async def go() -> Any:
        async with EngineClient(top_engine, timeout_s=120) as engine:
            try:
                return [
                    await rollout(
                        prompt,
                        group_size=3,
                        engine=engine,
                        reward=lambda s, p: 1.0,
                        family=family,
                        step=1,
                    )
                    for _ in range(2)
                ]
            finally:
                await rollout.close()

    groups = loop_thread.run(go(), timeout=300)
    turns = [len(s.metadata["turns"]) for g in groups for s in g.samples]
    assert max(turns) >= 2, turns  # at least one sample spans several engine turns
    packed = pack(groups)
    # masked tool results between the turns
    assert any(0 in s.loss_mask[: max(i for i, m in enumerate(s.loss_mask) if m)]
               for g in groups for s in g.samples if len(s.metadata["turns"]) > 1)  # fmt: skip

    options = FSDP2Options(micro_batch_tokens=160)
    with build_trainer(options, true_on_policy=True) as trainer:
        trainer.setup(str(mixing_model))
        lp, _ = trainer.compute_logprobs(groups)
    check_on_policy(lp, packed.rollout_logprobs, packed.response_mask, packed.group_index)
    assert int(packed.response_mask.sum()) > 0
