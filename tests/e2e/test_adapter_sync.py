"""Adapter-only weight sync over every transport, into a real embedded engine process: the
transport carries a LoRA adapter's tensors alone, the engine keeps its base weights and serves
the adapter under its name, a second update replaces it in place, and what the engine then
generates is what ``peft``'s merged model computes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import generate as generate_all
from core_support import lora_engine

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 13, 17], [1, 7, 3, 8]]
GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[str]:
    with lora_engine(tiny_qwen3, max_running_requests=4) as url:
        yield url


def make_adapter(base: Path, out: Path, seed: int) -> tuple[Any, dict[str, Any], list[Any]]:
    """A rank-4 adapter on every projection with random A and B: (merged model, its
    adapter_config.json, its PEFT-named tensors)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.2)
    peft_model.save_pretrained(out)
    tensors = [(n, t.clone()) for n, t in get_peft_model_state_dict(peft_model).items()]
    config = json.loads((out / "adapter_config.json").read_text())
    fresh = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(fresh, out).merge_and_unload().eval()
    return merged, config, tensors


def transport(name: str) -> Any:
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    record = load_plugins().registry.get(Kind.TRANSPORT, name)
    options = {"broadcast": {"backend": "gloo", "timeout_s": 60}}.get(name, {"timeout_s": 60})
    return record.build(record.config.model_validate(options))


def generate(url: str, lora: str | None) -> list[Any]:
    return generate_all(url, PROMPTS, GREEDY, lora)


def expected(model: Any, prompt: list[int], out: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


@pytest.mark.parametrize("name", ["colocated", "broadcast", "p2p"])
def test_adapter_alone_travels_and_is_served(
    name: str, tiny_qwen3: Path, engine: str, tmp_path: Path
) -> None:
    import torch

    from miles_core.contracts import AdapterSync

    sender = transport(name)
    before = generate(engine, None)
    try:
        for version, seed in ((1, 11), (2, 12)):  # loaded, then replaced in place
            merged, config, tensors = make_adapter(tiny_qwen3, tmp_path / f"a{version}", seed)
            metrics = sender.send(
                iter(tensors),
                version=version,
                engines=[engine],
                adapter=AdapterSync(name="policy", config=config),
            )
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            assert metrics["sync/bytes"] == pytest.approx(nbytes, rel=0.05), metrics
            out = generate(engine, "policy")
            for prompt, result in zip(PROMPTS, out, strict=True):
                want = expected(merged, prompt, list(result.output_ids))
                torch.testing.assert_close(list(result.logprobs), want, atol=1e-5, rtol=0)
                greedy = merged.generate(
                    torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5
                )[0, len(prompt) :].tolist()
                assert list(result.output_ids) == greedy
            assert asyncio.run(_version(engine)) == str(version)
        # The base model is untouched: requests without the adapter are served as before.
        after = generate(engine, None)
        assert [r.output_ids for r in after] == [r.output_ids for r in before]
        assert [r.logprobs for r in after] == [r.logprobs for r in before]
    finally:
        sender.close()
        asyncio.run(_unload(engine))


async def _version(url: str) -> str | None:
    from miles_engine_client import EngineClient

    client = EngineClient(url)
    try:
        return await client.get_weight_version()
    finally:
        await client.close()


async def _unload(url: str) -> None:
    from miles_engine_client import EngineClient

    client = EngineClient(url)
    try:
        await client.unload_lora_adapter("policy")
    finally:
        await client.close()
