"""Per-token weight versions across a weight update, on a live embedded engine process: the
asynchronous loop's engine view pauses the engine as the loop does (``retract``: abort and
continue; ``freeze``: in place), the engine's version changes, generation resumes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_core.data import Group, Sample
from miles_core.runtime.schedules.slots import EngineSlots, restamp_versions

PROMPT = [5, 17, 33, 9]
NEW = 160


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[tuple[Any, str]]:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(EmbeddedEngineConfig(max_running_requests=4, num_threads=1))
    try:
        yield launcher, launcher.launch(str(tiny_llama), index=0)
    finally:
        launcher.shutdown()


def _teacher_logprobs(model_path: Path, prompt: list[int], output: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output).view(-1, 1)).view(-1).tolist()


async def _across_update(launcher: Any, url: str, mode: str, new_version: str) -> tuple:
    client = launcher.client(url)
    slots = EngineSlots(client, capacity=4, version=int(await client.get_weight_version()))
    old = slots.version
    record: list[Any] = []
    params = {"max_new_tokens": NEW, "ignore_eos": True, "temperature": 1.0}
    calls = [
        asyncio.ensure_future(slots.generate(PROMPT, {**params, "sampling_seed": s}, record=record))
        for s in (1, 2)
    ]
    # let both requests produce some tokens, then update as the loop does
    while (await client.get_server_info())["internal_states"][0]["generated_tokens"] < 20:
        await asyncio.sleep(0.02)
    slots.close_gate(retract=mode == "retract")
    await client.pause_generation("abort" if mode == "retract" else "in_place")
    await client.update_weight_version(new_version, abort_all_requests=False)
    slots.version = int(new_version)
    await client.continue_generation()
    slots.open_gate()
    results = await asyncio.gather(*calls)
    engine_version = await client.get_weight_version()
    await client.close()
    return old, results, record, engine_version


@pytest.mark.slow
def test_retract_continues_requests_and_splits_their_versions(
    engine: tuple[Any, str], tiny_llama: Path
) -> None:
    launcher, url = engine
    old, results, record, _ = asyncio.run(_across_update(launcher, url, "retract", "7"))
    assert len(record) == 2
    by_ids = {ids: (logprobs, versions) for ids, logprobs, versions in record}
    for result in results:
        assert result.finish_reason == "length" and len(result.output_ids) == NEW
        logprobs, versions = by_ids[tuple(result.output_ids)]  # recorded in finishing order
        assert list(logprobs) == result.logprobs
        # tokens before the update carry the old version, those after the new one, in order
        first_new = versions.index(7)
        assert 0 < first_new < NEW, versions
        assert versions == [old] * first_new + [7] * (NEW - first_new)
        assert result.weight_version == str(old)  # the oldest version of its tokens
        # the continuation saw prompt + partial response: log-probs of the whole response
        # are those of one teacher-forced forward (the weights themselves did not change)
        teacher = _teacher_logprobs(tiny_llama, PROMPT, result.output_ids)
        assert max(abs(a - b) for a, b in zip(teacher, result.logprobs, strict=True)) < 1e-4


@pytest.mark.slow
def test_freeze_keeps_requests_in_place_and_stamps_the_oldest_version(
    engine: tuple[Any, str],
) -> None:
    launcher, url = engine
    old, results, record, engine_version = asyncio.run(_across_update(launcher, url, "freeze", "9"))
    assert engine_version == "9"
    assert len(record) == 2
    for result, (_, _, versions) in zip(results, record, strict=True):  # all alike: any order
        assert result.finish_reason == "length" and len(result.output_ids) == NEW
        # the engine reports only the version a request ended with (9); the tokens from
        # before the update were not made by it, so the request keeps the version it started
        assert result.raw["meta_info"]["weight_version"] == "9"
        assert versions == [old] * NEW and result.weight_version == str(old)


def test_restamp_gives_each_generation_its_versions() -> None:
    sample = Sample(prompt_ids=[1, 2])
    sample.append([10, 11, 12], logprobs=[-0.1, -0.2, -0.3], version=3)
    sample.append([99], trained=False)  # an environment token between two turns
    sample.append([13, 14], logprobs=[-0.4, -0.5], version=4)
    other = Sample(prompt_ids=[1, 2])
    other.append([20, 21], logprobs=[-1.0, -1.1], version=3)  # matches no record: kept
    group = Group(samples=[sample, other])
    restamp_versions(
        group,
        [
            ((10, 11, 12), (-0.1, -0.2, -0.3), [3, 4, 4]),
            ((13, 14), (-0.4, -0.5), [4, 5]),
            ((20, 21), (-1.0, -9.9), [7, 7]),  # same ids, other log-probs: another generation
        ],
    )
    assert sample.versions == [3, 4, 4, -1, 4, 5]
    assert other.versions == [3, 3]
    assert group.oldest_version == 3 and group.staleness(5) == 2
