"""The engine gate: a real engine process (the embedded engine) drives the scripted session
through the real session server; the stored tokens are checked against the canonical render.

A scripted tiny Qwen3-2507 model (Qwen3's real vocabulary) calls the tool from engine output;
SmolLM2-135M-Instruct (the real model) answers freely; a session whose stored tokens are
altered fails with the turn named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies import deepseek_v4, qwen3, qwen3_5
from miles_modelfamilies.engine_gate import (
    check_session,
    drive_session,
    make_scripted_model,
    scripted_reply,
)

from miles_core.families import GateReport, family_status, verify_family


@pytest.fixture(autouse=True)
def cert_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "certs"
    monkeypatch.setenv("MILES_CERT_DIR", str(folder))
    return folder


def test_engine_gate_scripted_reply_has_distinct_tokens_and_parses() -> None:
    fam = qwen3.build()
    last, ids, text, calls = scripted_reply(fam)
    assert calls and fam.decode(ids) == text and ids[-1] == 151645
    sources = [last, *ids[:-1]]
    assert len(set(sources)) == len(sources)  # a bigram model can follow it
    parsed = fam.parse_assistant(text)
    assert parsed["tool_calls"][0]["function"]["name"] == "lookup"
    assert parsed["reasoning_content"] == "Checking."
    # DeepSeek V4's DSML repeats the special token ｜DSML｜: no bigram spelling calls a tool.
    _, _, ds_text, ds_calls = scripted_reply(deepseek_v4.build())
    assert not ds_calls and ds_text.endswith("<｜end▁of▁sentence｜>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The qwen3_thinking_2507 family and an embedded engine serving its scripted model."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    fam = qwen3_5.build_thinking_2507()
    path, _, calls = make_scripted_model(fam, tmp_path_factory.mktemp("tiny-2507"))
    assert calls
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=1, context_length=16384, num_threads=1, startup_timeout_s=300
        )
    )
    url = launcher.launch(str(path), index=0)
    try:
        yield fam, url
    finally:
        launcher.shutdown()


@pytest.mark.slow
def test_engine_gate_passes_for_a_scripted_tiny_model(
    tiny: tuple[Any, str], cert_dir: Path
) -> None:
    fam, url = tiny
    report = verify_family(
        fam, gates=("cpu", "engine"), engine_options={"engine_url": url, "scripted": True}
    )
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert engine["turns"] == 4 and engine["rollbacks"] == 1
    assert engine["engine_tool_calls"] >= 3  # turns 1, 2 and 4 of the path... every reply calls
    # The scripted reply leaves out the template's newlines: drift, counted, not a failure.
    assert engine["text_drift_turns"] == 4 and engine["replies_without_stop_token"] == []
    assert "assistant-text drift in 4 turn(s)" in report.format()
    cert = json.loads(Path(report.certificate or "").read_text())
    assert cert["gates"] == ["cpu", "engine"] and cert["details"]["engine"]["rollbacks"] == 1
    status = family_status(fam)
    assert status["status"] == "verified" and status["gates"] == ["cpu", "engine"]
    # A later CPU-only run keeps the engine gate in the certificate.
    again = verify_family(fam)
    assert json.loads(Path(again.certificate or "").read_text())["gates"] == ["cpu", "engine"]


@pytest.mark.slow
def test_engine_gate_fails_on_altered_tokens_naming_the_turn(tiny: tuple[Any, str]) -> None:
    fam, url = tiny
    session = drive_session(fam, url)
    ok = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=ok)
    assert not ok.failures, [f.format() for f in ok.failures]

    # A non-assistant token changed: the user's text of turn 3 is not the canonical text.
    turn3 = session.tip.path()[2]
    saved = list(turn3.env_ids)
    turn3.env_ids[-8] = fam.tokenize(" banana")[0]
    report = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=report)
    turn3.env_ids[:] = saved
    text = "\n".join(f.format() for f in report.failures)
    assert "engine_text check" in text and "turn 3" in text and " banana" in text

    # A special token of a generated reply replaced by ordinary text: a special-token failure.
    turn1 = session.tip.path()[0]
    end = turn1.gen_ids.index(fam.tokenizer.token_id("</tool_call>"))
    turn1.gen_ids[end : end + 1] = fam.tokenize("</tool")
    report = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=report)
    assert any(
        f.check == "engine_tokens" and "special tokens" in f.detail and "turn 1" in f.detail
        for f in report.failures
    ), [f.format() for f in report.failures]


@pytest.mark.slow
def test_engine_gate_passes_for_smollm2_on_the_real_model() -> None:
    from miles_modelfamilies import smollm2

    fam = smollm2.build()
    report = verify_family(fam, gates=("engine",))
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert engine["model"].endswith("SmolLM2-135M-Instruct") and not engine["scripted"]
    assert engine["turns"] == 4 and engine["rollbacks"] == 1
    assert "text_drift_turns" in engine and "token_drift_turns" in engine
