"""Two LoRA adapters in one FSDP2 trainer, served by one real embedded engine: a train step on
adapter A's groups leaves adapter B exactly as it was — its tensors in the trainer and what the
engine generates with it, token for token and log-prob for log-prob — after both adapters are
published again, as a run publishes them after every step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import generate, lora_engine

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 13, 17], [1, 7, 3, 8], [2, 4, 6], [9, 9, 1, 2]]
GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[str]:
    with lora_engine(tiny_qwen3, max_running_requests=8) as url:
        yield url


def _generate(url: str, lora: str | None) -> list[tuple[list[int], list[float]]]:
    return [(list(r.output_ids), list(r.logprobs)) for r in generate(url, PROMPTS, GREEDY, lora)]


def _groups(adapter: str, outputs: list[tuple[list[int], list[float]]]) -> list[Any]:
    """Two groups of the adapter's own generations, rewards 1, 0, 1, 0 within each."""
    from miles_core.data import Group, Sample

    groups = []
    for g in range(2):
        samples = []
        for i in range(4):
            prompt = PROMPTS[(2 * g + i) % len(PROMPTS)]
            ids, logprobs = outputs[(2 * g + i) % len(outputs)]
            sample = Sample(prompt_ids=list(prompt), adapter=adapter)
            sample.append(ids, logprobs=logprobs, version=0)
            sample.reward = float(i % 2 == 0)
            samples.append(sample)
        groups.append(Group(samples=samples, adapter=adapter))
    return groups


def test_training_one_adapter_leaves_the_other_bit_for_bit(tiny_qwen3: Path, engine: str) -> None:
    from miles_core import Kind
    from miles_core.contracts import AdapterSync
    from miles_core.plugins import load_plugins
    from miles_core.registry import build_trainer

    registry = load_plugins().registry
    fsdp2 = registry.get(Kind.TRAINER_BACKEND, "fsdp2")
    lora = registry.get(Kind.ADAPTER, "lora")
    options = {
        n: lora.config.model_validate({"rank": 4, "alpha": 8, "served_name": n})
        for n in ("one", "two")
    }
    trainer = build_trainer(
        registry,
        "fsdp2",
        fsdp2.config.model_validate({"lr": 5e-2, "cpu_threads": 1}),
        [("lora", o) for o in options.values()],
    )
    algorithm = registry.get(Kind.ALGORITHM, "grpo").build(None)
    colocated = registry.get(Kind.TRANSPORT, "colocated")
    sender = colocated.build(colocated.config.model_validate({"timeout_s": 60}))

    def publish(version: int) -> None:
        for name, o in options.items():
            sync = AdapterSync(name=name, config=lora.build(o).engine_config())
            sender.send(
                trainer.export_weights(name), version=version, engines=[engine], adapter=sync
            )

    try:
        trainer.setup(str(tiny_qwen3))
        publish(0)
        plain = _generate(engine, None)
        # "two" learns first, so that what must stay unchanged is not simply the base
        trainer.train_step(_groups("two", _generate(engine, "two")), algorithm)
        publish(1)
        b_before, a_before = _generate(engine, "two"), _generate(engine, "one")
        assert b_before != plain
        prints = trainer.fingerprint()

        metrics = trainer.train_step(_groups("one", a_before), algorithm)
        publish(2)
        assert metrics["one/grad_norm"] > 0 and "two/grad_norm" not in metrics
        after = trainer.fingerprint()
        assert after["adapter/two"] == prints["adapter/two"]
        assert after["adapter/one"] != prints["adapter/one"]
        assert _generate(engine, "two") == b_before  # tokens and log-probs, bit for bit
        assert _generate(engine, "one") != a_before
    finally:
        sender.close()
        trainer.close()
