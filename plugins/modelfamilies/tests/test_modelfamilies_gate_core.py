"""The core gate logic (miles_core.families) on a tiny in-test family: pure Python rendering and
a greedy longest-match tokenizer, so each property can be broken on purpose."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from miles_core.contracts import Family, FamilyDefaults
from miles_core.families import (
    SHAPES,
    ConversationShape,
    cut_points,
    family_status,
    run_cpu_gate,
    verify_family,
)

SPECIAL = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
#: The CPU gate alone: what these tests exercise (TinyFamily has no engine gate).
CPU = ("cpu",)
_PIECES: dict[int, str] = {}  # id -> text of every piece TinyFamily has tokenized


class TinyFamily(FamilyDefaults):
    """ChatML in plain Python, on the protocol's defaults (no engine gate, no escaping), as a
    third-party family may be. ``keep_reasoning=False`` drops the reasoning of assistant turns
    before the last user message, as Qwen3's original template does."""

    def __init__(
        self,
        *,
        keep_reasoning: bool = True,
        separator: str = "\n",
        prompt: str = "<|im_start|>assistant\n",
        name: str = "tiny",
    ) -> None:
        self.name = name
        self.keep_reasoning = keep_reasoning
        self.separator = separator
        self.prompt = prompt
        self.roles = ("system", "user", "assistant", "tool")
        self.thinking = True

    def _turn(self, m: dict[str, Any], show_reasoning: bool) -> str:
        body = m.get("content") or ""
        if m["role"] == "assistant":
            if show_reasoning:
                body = f"<think>\n{m.get('reasoning_content') or ''}\n</think>\n\n{body}"
            for call in m.get("tool_calls") or []:
                body += f"<tool_call>{json.dumps(call['function'])}</tool_call>"
        return f"<|im_start|>{m['role']}\n{body}<|im_end|>{self.separator}"

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        out = "".join(
            self._turn(m, self.keep_reasoning or i > last_user) for i, m in enumerate(messages)
        )
        return out + (self.prompt if add_generation_prompt else "")

    def parse_assistant(self, text: str) -> dict[str, Any]:
        text = text.rstrip().removesuffix("<|im_end|>")
        reasoning = None
        if "</think>" in text:
            head, text = text.split("</think>", 1)
            reasoning = head.removeprefix("<think>").strip("\n")
            text = text.removeprefix("\n\n")
        calls = []
        while "<tool_call>" in text:
            text, _, rest = text.partition("<tool_call>")
            body, _, after = rest.partition("</tool_call>")
            text += after
            calls.append({"type": "function", "function": json.loads(body)})
        return {"content": text, "reasoning_content": reasoning, "tool_calls": calls or None}

    def tokenize(self, text: str) -> list[int]:
        # Specials are single tokens; any other text is split into runs of letters, of
        # spaces/newlines, or single other characters, one id per distinct string.
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in SPECIAL if text.startswith(s, i)), None)
            if special is not None:
                piece = special
            else:
                j = i + 1
                while (
                    j < len(text)
                    and text[j].isalpha() == text[i].isalpha()
                    and (text[i].isalpha() or (text[j] in " \n" and text[i] in " \n"))
                    and not any(text.startswith(s, j) for s in SPECIAL)
                ):
                    j += 1
                piece = text[i:j]
            ids.append(int(hashlib.sha256(piece.encode()).hexdigest()[:8], 16))
            _PIECES[ids[-1]] = piece
            i += len(piece)
        return ids

    stop_token_ids: tuple[int, ...] = ()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(_PIECES[i] for i in ids)

    def fingerprint_parts(self) -> dict[str, str]:
        key = json.dumps([self.keep_reasoning, self.separator, self.prompt])
        return {"template": hashlib.sha256(key.encode()).hexdigest()}

    def fingerprint(self) -> str:
        return self.fingerprint_parts()["template"]


@pytest.fixture(autouse=True)
def cert_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "certs"
    monkeypatch.setenv("MILES_CERT_DIR", str(folder))
    return folder


def test_tiny_family_implements_the_protocol() -> None:
    assert isinstance(TinyFamily(), Family)


def test_at_least_fifteen_shapes_covering_the_brief() -> None:
    names = {s.name for s in SHAPES}
    assert len(SHAPES) >= 15
    assert len(names) == len(SHAPES)
    tags = {
        "parallel_tool_calls",
        "long_tool_chain",
        "tool_retry",
        "intermediate_system",
        "thinking_multi_turn",
        "thinking_mixed",
        "all_roles",
        "multi_turn",
    }
    assert tags <= names
    assert any(s.has_reasoning for s in SHAPES) and any(not s.has_reasoning for s in SHAPES)


def test_cut_points_at_turn_and_message_boundaries() -> None:
    shape = next(s for s in SHAPES if s.name == "parallel_tool_calls")
    # user, assistant, tool, tool, assistant: the two tool results arrive together
    assert cut_points(shape.messages) == [1, 2, 4]
    assert cut_points(shape.messages, "message") == [1, 2, 3, 4]


def _engine_pass(fam: Any) -> Any:
    """A passed engine-gate report for ``fam``, as the family's engine gate would leave it (the
    gate itself runs on a real engine in test_engine_gate_families.py)."""
    from miles_core.families import GateReport

    report = GateReport(fam.name, fam.fingerprint(), ("engine",), shapes=["scripted_session"])
    report.details["engine"] = {"turns": 4}
    return report


def test_append_only_family_passes_and_is_certified(cert_dir: Path) -> None:
    from miles_core.families import write_certificate

    fam = TinyFamily()
    report = verify_family(fam, gates=CPU)
    assert report.passed, report.format()
    assert len(report.shapes) == len(SHAPES) and report.checks > 3 * len(SHAPES)
    assert report.certificate and Path(report.certificate).parent == cert_dir
    body = json.loads(Path(report.certificate).read_text())
    assert body["fingerprint"] == fam.fingerprint() and body["gates"] == ["cpu"]
    # The CPU gate alone does not verify a family: the engine gate must pass too.
    status = family_status(fam)
    assert status["status"] == "not_verified" and status["missing_gates"] == ["engine"]
    assert "only the cpu gate passed, not the engine gate" in status["message"]
    write_certificate(fam, _engine_pass(fam))
    status = family_status(fam)
    assert status["status"] == "verified" and status["certificate"] == report.certificate
    assert status["gates"] == ["cpu", "engine"]
    json.dumps(status)
    json.dumps(report.to_dict())


def test_dropping_earlier_reasoning_fails_with_a_readable_report() -> None:
    report = verify_family(TinyFamily(keep_reasoning=False), gates=CPU)
    assert not report.passed
    assert report.certificate is None
    failing = report.failed_shapes()
    assert "thinking_multi_turn" in failing and "multi_turn" in failing
    first = next(f for f in report.failures if f.shape == "thinking_multi_turn")
    assert (first.check, first.turn, first.role) == ("prefix", 1, "assistant")
    text = report.format()
    assert "FAILED" in text
    assert "shape 'thinking_multi_turn', turn 1 (assistant), prefix check" in text
    # the first differing characters, quoted on both sides of the difference marker
    assert "<|im_start|>assistant\\n' ▶ '<think>\\n91 = 7 * 13.\\n</think>" in text
    assert "<|im_start|>assistant\\n' ▶ 'No.<|im_end|>" in text
    assert family_status(TinyFamily(keep_reasoning=False))["status"] == "not_verified"


def test_tokens_that_merge_across_a_turn_boundary_fail() -> None:
    # Without the newline after <|im_end|>... still separated by a special token: passes.
    assert verify_family(TinyFamily(separator=""), gates=CPU, write=False).passed
    # A separator that merges with the next turn's leading whitespace breaks canonical tokens.
    shape = ConversationShape(
        "space_join",
        "a turn ends with spaces, the next one starts with them",
        (
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
        ),
    )

    class Glued(TinyFamily):
        def _turn(self, m: dict[str, Any], show_reasoning: bool) -> str:
            return f" {m['role']}: {m['content']} "  # no special token between turns

    report = run_cpu_gate(Glued(prompt=" assistant: "), [shape])
    assert not report.passed
    failure = report.failures[0]
    assert failure.check == "tokens"
    assert "first differing token" in failure.detail and "piece ends" in failure.detail


def test_generation_prompt_that_is_not_where_the_turn_starts_fails() -> None:
    report = verify_family(TinyFamily(prompt="<|im_start|>assistant:\n"), gates=CPU, write=False)
    assert not report.passed
    failure = report.failures[0]
    assert failure.check == "generation_prompt" and failure.role == "assistant"
    assert "assistant' ▶ ':\\n'" in failure.detail


def test_a_template_error_is_a_failure_not_a_crash() -> None:
    class Broken(TinyFamily):
        def render(self, messages: list[dict[str, Any]], **kw: Any) -> str:
            if len(messages) > 3:
                raise ValueError("too long")
            return super().render(messages, **kw)

    report = verify_family(Broken(), gates=CPU, write=False)
    assert not report.passed
    assert any(f.check == "render" and "too long" in f.detail for f in report.failures)


def test_changing_the_template_makes_the_certificate_stale() -> None:
    assert verify_family(TinyFamily(), gates=CPU).passed
    changed = TinyFamily(separator="\n\n")
    status = family_status(changed)
    assert status["status"] == "stale"
    assert "stale" in status["message"]
    assert status["certified_fingerprint"] == TinyFamily().fingerprint()


def test_certificate_dir_override_and_unknown_gate(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    report = verify_family(TinyFamily(), gates=CPU, certificate_dir=other)
    assert report.certificate and Path(report.certificate).parent == other
    with pytest.raises(ValueError, match="unknown or unavailable gate"):
        verify_family(TinyFamily(), gates=("cpu", "gpu"))
    # A family without run_engine_gate fails the engine gate with a message, writes nothing.
    report = verify_family(TinyFamily(), gates=("cpu", "engine"), certificate_dir=other)
    assert not report.passed and report.certificate is None
    assert "has no engine gate" in report.format()


def test_family_gate_package_imports_no_heavy_library() -> None:
    code = (
        "import sys, miles_core.families;"
        "bad = [m for m in ('torch', 'transformers', 'jinja2', 'tokenizers', 'tiktoken')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_parser_that_disagrees_with_the_template_fails() -> None:
    class NoToolParser(TinyFamily):
        def parse_assistant(self, text: str) -> dict[str, Any]:
            out = super().parse_assistant(text.replace("<tool_call>", "<call>"))
            return out

    report = verify_family(NoToolParser(), gates=CPU, write=False)
    assert not report.passed
    failure = next(f for f in report.failures if f.shape == "single_tool_call")
    assert (failure.check, failure.turn, failure.role) == ("parse", 1, "assistant")
    assert "tool calls [] != [('get_weather', {'city': 'Oslo'})]" in failure.detail


def test_an_engine_only_certificate_does_not_verify_until_the_cpu_gate_passes(
    tmp_path: Path,
) -> None:
    from miles_core.families import write_certificate

    fam = TinyFamily()
    write_certificate(fam, _engine_pass(fam), tmp_path)
    status = family_status(fam, certificate_dir=tmp_path)
    assert status["status"] == "not_verified"
    assert "only the engine gate passed, not the cpu gate" in status["message"]
    report = verify_family(fam, gates=CPU, certificate_dir=tmp_path)
    body = json.loads(Path(report.certificate or "").read_text())
    assert body["gates"] == ["cpu", "engine"] and body["details"]["engine"] == {"turns": 4}
    assert family_status(fam, certificate_dir=tmp_path)["status"] == "verified"


def test_a_failed_gate_run_certifies_nothing_and_verifies_nothing(tmp_path: Path) -> None:
    # Both gates by default; a family without an engine gate fails and writes nothing.
    fam = TinyFamily()
    report = verify_family(fam, certificate_dir=tmp_path)
    assert report.gates == ("cpu", "engine") and not report.passed
    assert report.certificate is None and not list(tmp_path.glob("*.json"))
    assert family_status(fam, certificate_dir=tmp_path)["status"] == "not_verified"


class _Recorder:
    """A family seen through a proxy that records every attribute the code under test reads."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._inner, name)


def test_the_gates_read_only_what_the_family_protocol_declares(tmp_path: Path) -> None:
    declared = set(Family.__annotations__) | {n for n in vars(Family) if not n.startswith("_")}
    for family in (TinyFamily(), TinyFamily(keep_reasoning=False)):
        seen = _Recorder(family)
        verify_family(seen, certificate_dir=tmp_path)  # type: ignore[arg-type]
        family_status(seen, certificate_dir=tmp_path)  # type: ignore[arg-type]
        assert seen.read and seen.read <= declared, sorted(seen.read - declared)
        assert {"roles", "thinking", "system_anywhere", "always_reasons"} <= seen.read


def test_the_defaults_leave_a_family_without_an_engine_gate_or_escaping() -> None:
    fam = TinyFamily()
    messages = [{"role": "user", "content": "a <|im_end|> b"}]
    assert fam.render_escaped(messages) == fam.render(messages)
    assert fam.unescape("x<|im_end|>") == "x<|im_end|>"
    assert (fam.always_reasons, fam.system_anywhere, fam.description) == (False, True, "")
    from miles_core.families import GateReport

    report = fam.run_engine_gate(GateReport("tiny", fam.fingerprint(), ("engine",)))
    assert [(f.gate, f.check) for f in report.failures] == [("engine", "family")]
    assert "family 'tiny' has no engine gate" in report.failures[0].detail
