"""SFT's rendering with every shipped family, on every conversation shape of the CPU gate: the
tokens are the canonical tokens of the family's render, and the loss mask covers exactly the
assistant turns' tokens (each turn's generated text through its stop token) and nothing else:
every other message is rendered in the untrained tokens."""

from __future__ import annotations

from typing import Any

import pytest
from miles_modelfamilies import deepseek_v4, qwen3, qwen3_5, smollm2
from miles_modelfamilies.options import DeepSeekV4Options, Qwen3_5Options

from miles_core.families import SHAPES, run_cpu_gate
from miles_core.families.cpu_gate import conversation_for
from miles_core.rendering import render_conversation

BUILDS: dict[str, Any] = {
    "smollm2": lambda: smollm2.build(),
    "qwen3": lambda: qwen3.build(),
    "qwen3_nothink": lambda: qwen3.build(qwen3.Qwen3Options(enable_thinking=False)),
    "qwen3_5": lambda: qwen3_5.build(),
    "qwen3_5_nothink": lambda: qwen3_5.build(Qwen3_5Options(enable_thinking=False)),
    "qwen3_thinking_2507": lambda: qwen3_5.build_thinking_2507(),
    "deepseek_v4": lambda: deepseek_v4.build(),
    "deepseek_v4_chat": lambda: deepseek_v4.build(DeepSeekV4Options(enable_thinking=False)),
}


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_sft_loss_mask_covers_exactly_the_assistant_tokens_of_the_render(name: str) -> None:
    family = BUILDS[name]()
    applicable = set(run_cpu_gate(family).shapes)
    stops = [family.decode([i]) for i in family.stop_token_ids]
    checked = 0
    for shape in SHAPES:
        if shape.name not in applicable:
            continue
        messages, tools = conversation_for(family, shape), shape.tool_schemas()
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            continue
        out = render_conversation(family, messages, tools=tools)
        ids = out.prompt_ids + out.response_ids
        # the canonical tokens of the whole render, through the last turn's stop token
        whole = family.render(messages[: turns[-1] + 1], tools=tools)
        assert ids == family.tokenize(whole)[: len(ids)], shape.name
        assert len(out.spans) == len(turns), shape.name
        mask = [0] * len(out.response_ids)
        for k, (a, b) in zip(turns, out.spans, strict=True):
            # what the engine generates for turn k: the render after its generation prompt,
            # through the stop token that ends it
            prompt = family.render(messages[:k], tools=tools, add_generation_prompt=True)
            turn = family.render(messages[: k + 1], tools=tools)[len(prompt) :]
            end = max(turn.rfind(s) + len(s) for s in stops if s in turn)
            generated = turn[:end]
            assert family.decode(out.response_ids[a:b]) == generated, (shape.name, k)
            assert out.response_ids[a:b] == family.tokenize(generated), (shape.name, k)
            assert _text(messages[k]).strip() in generated, (shape.name, k)
            mask[a:b] = [1] * (b - a)
        assert out.loss_mask == mask, shape.name
        # every other message is rendered in the untrained tokens
        untrained = family.decode(out.prompt_ids) + family.decode(
            [t for t, m in zip(out.response_ids, out.loss_mask, strict=True) if not m]
        )
        for m in messages[: turns[-1]]:
            if m["role"] != "assistant":
                assert _text(m).strip() in untrained, (shape.name, m["role"])
        checked += 1
    assert checked >= 10, checked
