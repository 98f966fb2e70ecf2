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
    return script_model(tmp_path_factory.mktemp("script-mixing"), mix=5)


@pytest.fixture(scope="module")
def top_engine(mixing_model: Path, sessions_support: Any) -> Iterator[str]:
    """A live embedded engine in true on-policy mode, batching up to 3 sessions' requests."""
    with sessions_support.engine(mixing_model, true_on_policy=True) as url:
        yield url


@pytest.mark.slow
def test_multi_turn_session_samples_are_recomputed_bitwise(
    mixing_model: Path,
    top_engine: str,
    family: Any,
    loop_thread: Any,
    tools: Any,
    sessions_support: Any,
) -> None:
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build as build_trainer
    from miles_trainer_common.batch import pack
    from miles_trainer_common.logprobs import check_on_policy

    groups = sessions_support.rollouts(top_engine, family, tools, loop_thread)
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
