"""Templates read from where they ship: the Qwen families build from the installed
``miles-tito-tokenizers`` files byte for byte (this package keeps no copy), the Qwen3
``keep-reasoning`` variant is the upstream ``qwen3_fixed.jinja`` with ``clear_thinking: false``
(the upstream default drops earlier reasoning and fails the CPU gate), the template text stays
in the fingerprint, and a missing or other version of the package is a clear error."""

from __future__ import annotations

import copy
import importlib.util
from importlib import metadata, resources
from pathlib import Path

import pytest
import tomllib
from miles_modelfamilies import qwen3, qwen3_5, upstream
from miles_modelfamilies.family import TemplateFamily

from miles_core.families import run_cpu_gate


def _package_template(name: str) -> str:
    # located apart from the code under test: the package's import location, not its metadata
    spec = importlib.util.find_spec("miles_tito_tokenizers")
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / "templates" / name).read_bytes().decode("utf-8")


@pytest.fixture(scope="module")
def families() -> dict[str, TemplateFamily]:
    return {
        "qwen3_fixed.jinja": qwen3.build(),
        "qwen3.5_fixed.jinja": qwen3_5.build(),
        "qwen3_thinking_2507_and_next_fixed.jinja": qwen3_5.build_thinking_2507(),
    }


def test_families_render_the_installed_packages_files(families: dict[str, TemplateFamily]) -> None:
    for name, fam in families.items():
        assert fam.template == _package_template(name), name
        assert fam.template_args["clear_thinking"] is False, name
    # this package ships only the template no package here ships: Qwen3's original
    shipped = resources.files("miles_modelfamilies") / "templates"
    assert sorted(p.name for p in shipped.iterdir() if p.name.endswith(".jinja")) == ["qwen3.jinja"]


def test_the_template_text_stays_in_the_fingerprint(families: dict[str, TemplateFamily]) -> None:
    for fam in families.values():
        changed = fam.replace_template(fam.template + " ")
        parts, new = fam.fingerprint_parts(), changed.fingerprint_parts()
        assert [p for p in parts if parts[p] != new[p]] == ["template"]


def _with_args(fam: TemplateFamily, **args: object) -> TemplateFamily:
    clone = copy.copy(fam)
    clone.template_args = {**fam.template_args, **args}
    clone.__post_init__()
    return clone


MULTI_TURN = [
    {"role": "user", "content": "7*13?"},
    {"role": "assistant", "content": "91.", "reasoning_content": "7*13=91."},
    {"role": "user", "content": "Sure?"},
    {"role": "assistant", "content": "Yes.", "reasoning_content": "Checked."},
]


def test_keep_reasoning_is_the_upstream_template_with_clear_thinking_off() -> None:
    fam = qwen3.build()
    assert fam.template_args == {"enable_thinking": True, "clear_thinking": False}
    # every assistant turn keeps its reasoning: what the shipped variant rendered before
    assert fam.render(MULTI_TURN) == (
        "<|im_start|>user\n7*13?<|im_end|>\n<|im_start|>assistant\n<think>\n7*13=91.\n"
        "</think>\n\n91.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nChecked.\n</think>\n\nYes.<|im_end|>\n"
    )
    # the argument does the work: the template's default drops the earlier reasoning
    dropping = _with_args(fam, clear_thinking=True)
    assert "7*13=91." not in dropping.render(MULTI_TURN)
    assert run_cpu_gate(fam).passed
    report = run_cpu_gate(dropping)
    assert not report.passed
    assert "thinking_multi_turn" in {f.shape for f in report.failures}


def test_missing_template_or_other_version_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(RuntimeError, match=r"ships no template 'nope.jinja'.*qwen3_fixed.jinja"):
        upstream.template_text("nope.jinja")
    with pytest.raises(ValueError, match="'latest'; allowed: keep-reasoning, original"):
        qwen3.template_text("latest")
    monkeypatch.setattr(upstream, "PINNED_VERSION", "0.0.9")
    installed = metadata.version(upstream.DISTRIBUTION)
    with pytest.raises(RuntimeError, match=rf"0\.0\.9, but {installed} is installed") as info:
        upstream.template_text("qwen3_fixed.jinja")
    assert "pip install 'miles-tito-tokenizers==0.0.9'" in str(info.value)
    monkeypatch.setattr(upstream, "DISTRIBUTION", "miles-no-such-distribution")
    with pytest.raises(RuntimeError, match="miles-no-such-distribution package, which is not"):
        upstream.template_text("qwen3_fixed.jinja")


def test_the_package_is_a_pinned_dependency_under_a_licence_that_allows_it() -> None:
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"{upstream.DISTRIBUTION}=={upstream.PINNED_VERSION}" in deps
    assert metadata.version(upstream.DISTRIBUTION) == upstream.PINNED_VERSION
    dist = metadata.distribution(upstream.DISTRIBUTION)
    assert dist.metadata["License"] == "Apache-2.0"
    licence = next(f for f in dist.files or () if str(f).endswith("licenses/LICENSE"))
    assert "Apache License" in Path(str(dist.locate_file(licence))).read_text()
