"""Gate shapes that catch token merges at turn boundaries, and the upstream project's
trajectories (``miles-tito-tokenizers``) run through every shipped family's CPU gate."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies import deepseek_v4
from miles_modelfamilies.gate_shapes import upstream_shapes
from miles_modelfamilies.options import DeepSeekV4Options
from miles_modelfamilies.testing import SHIPPED, build

from miles_core.families import BOUNDARY_SHAPES, SHAPES, run_cpu_gate, verify_family

README = Path(__file__).resolve().parents[1] / "README.md"


class _EncoderFormat(deepseek_v4.DeepSeekV4Family):
    """DeepSeek V4 rendered by the upstream encoder itself (what the family rendered before it
    wrote the generation prompt after a system message)."""

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        ref = pytest.importorskip("miles_tito_tokenizers.encoders.deepseek_v4")
        return str(
            ref.render_messages(
                list(messages), tools=tools, thinking_mode="thinking", drop_thinking=False
            )
        )


def _shape(name: str) -> Any:
    return next(s for s in BOUNDARY_SHAPES if s.name == name)


def test_boundaries_the_encoder_format_merges_a_system_message_into_the_answer() -> None:
    fam = deepseek_v4.build()
    encoder = _EncoderFormat(**{f.name: getattr(fam, f.name) for f in dataclasses.fields(fam)})
    report = run_cpu_gate(encoder, [_shape("system_after_tool_result_thinking")])
    assert not report.passed
    (failure,) = report.failures
    assert failure.check == "tokens"
    assert failure.shape == "system_after_tool_result_thinking"
    # stored '.', 'Got' (the engine continued after the system text); whole render '.G', 'ot'
    assert "'.', 'Got'" in failure.detail and "'.G', 'ot'" in failure.detail
    # the same conversation passes in the family's own render
    assert run_cpu_gate(fam, [_shape("system_after_tool_result_thinking")]).passed


def test_boundaries_the_default_gate_of_any_family_runs_the_boundary_shapes(
    tmp_path: Path,
) -> None:
    # what `miles family verify` runs: the core's shapes, boundary shapes included
    assert {s.name for s in BOUNDARY_SHAPES} <= {s.name for s in SHAPES}
    fam = deepseek_v4.build()
    encoder = _EncoderFormat(**{f.name: getattr(fam, f.name) for f in dataclasses.fields(fam)})
    report = verify_family(encoder, gates=("cpu",), certificate_dir=tmp_path)
    assert not report.passed and report.certificate is None
    failed = {(f.shape, f.check) for f in report.failures}
    assert ("system_after_tool_result_thinking", "tokens") in failed
    assert {shape for shape, _ in failed} <= {s.name for s in BOUNDARY_SHAPES}
    assert not list(tmp_path.iterdir())


def test_boundaries_deepseek_v4_writes_the_assistant_prompt_after_a_system_message() -> None:
    msgs = [
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Ok.", "reasoning_content": "Fine."},
    ]
    text = deepseek_v4.render(msgs)
    assert "Be brief.<｜Assistant｜><think>Fine.</think>Ok." in text
    # ending with a system message: the prompt only when asked for
    assert deepseek_v4.render(msgs[:2]).endswith("Be brief.")
    assert deepseek_v4.render(msgs[:2], add_generation_prompt=True).endswith(
        "Be brief.<｜Assistant｜><think>"
    )
    chat = deepseek_v4.render(msgs[:2], add_generation_prompt=True, thinking=False)
    assert chat.endswith("<｜Assistant｜></think>")


CONFIGS: dict[str, Any] = {name: (lambda n=name: build(n)) for name in SHIPPED}
CONFIGS["deepseek_v4_chat"] = lambda: deepseek_v4.build(DeepSeekV4Options(enable_thinking=False))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_boundaries_every_shipped_family_passes_the_boundary_shapes(name: str) -> None:
    fam = CONFIGS[name]()
    report = run_cpu_gate(fam, BOUNDARY_SHAPES)
    if not fam.system_anywhere:  # qwen3_5: every shape has a later system message
        assert not report.failures and not report.shapes
        assert all("system message" in why for why in report.skipped.values())
        return
    assert report.passed, report.format()
    want = [s.name for s in BOUNDARY_SHAPES if fam.thinking or not s.has_reasoning]
    assert report.shapes == want


def _readme_counts() -> dict[str, tuple[int, int]]:
    """The README's table of upstream trajectories: family -> (passed, skipped)."""
    section = README.read_text().split("### Upstream trajectories", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \|", section, re.M)
    return {name: (int(passed), int(skipped)) for name, passed, skipped in rows}


def test_boundaries_upstream_trajectories_come_from_the_package() -> None:
    from miles_tito_tokenizers.testing import RetrySystemTrajectory

    shapes = {s.name: s for s in upstream_shapes()}
    assert len(shapes) == 17
    retry = shapes["tito_RetrySystemTrajectory"]
    assert list(retry.messages) == RetrySystemTrajectory.MESSAGES
    assert not set(shapes) & {s.name for s in SHAPES}


@pytest.mark.parametrize("name", SHIPPED)
def test_boundaries_every_shipped_family_passes_the_upstream_trajectories(name: str) -> None:
    shapes = upstream_shapes()
    report = run_cpu_gate(build(name), shapes)
    assert report.passed, report.format()
    assert len(report.shapes) + len(report.skipped) == len(shapes)
    # the README says how many ran and how many the family's configuration skips
    assert _readme_counts()[name] == (len(report.shapes), len(report.skipped))
