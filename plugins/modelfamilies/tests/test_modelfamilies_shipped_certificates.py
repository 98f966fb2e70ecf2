"""Certificates that travel: a plugin ships its maintainer's certificate in ``certificates/``
of its package; an installed plugin's certificate verifies the family it names at the
fingerprint it records, on a machine whose own certificate folder is empty; one changed
character of the template makes the family ``stale``, naming the template."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies.testing import build

from miles_core.families import (
    GateReport,
    family_status,
    load_certificates,
    run_cpu_gate,
    shipped_certificate_dirs,
    write_certificate,
)


def _certify(fam: Any, folder: Path) -> Path:
    """The maintainer's certificate of ``fam`` in ``folder``: the CPU gate run here, the engine
    gate's pass recorded as the family's engine gate leaves it (that gate runs on a real engine
    in test_engine_gate_families.py and, end to end, in test_modelfamilies_third_party.py)."""
    cpu = run_cpu_gate(fam)
    assert cpu.passed, cpu.format()
    write_certificate(fam, cpu, folder)
    engine = GateReport(fam.name, fam.fingerprint(), ("engine",), shapes=["scripted_session"])
    engine.details["engine"] = {"turns": 4}
    return write_certificate(fam, engine, folder)


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed plugin ``miles-smol-certs`` (a package and its dist-info with an entry point
    in the group ``miles``) shipping a certificate of ``smollm2``; its ``certificates/``
    folder. The local certificate folder is empty."""
    site = tmp_path / "site"
    package = site / "miles_smol_certs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Ships a certificate of smollm2."""\n')
    info = site / "miles_smol_certs-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: miles-smol-certs\nVersion: 1.0.0\n"
    )
    (info / "entry_points.txt").write_text("[miles]\nsmol_certs = miles_smol_certs\n")
    _certify(build("smollm2"), package / "certificates")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MILES_CERT_DIR", str(tmp_path / "local"))
    yield package / "certificates"
    # loading the plugins imports the package: the next test's copy lives elsewhere
    sys.modules.pop("miles_smol_certs", None)


def test_shipped_certificate_is_found_through_the_entry_point(installed: Path) -> None:
    assert installed in shipped_certificate_dirs()


def test_shipped_certificate_verifies_the_family(installed: Path, tmp_path: Path) -> None:
    fam = build("smollm2")
    status = family_status(fam)
    assert status["status"] == "verified", status
    assert status["source"] == "shipped" and Path(status["certificate"]).parent == installed
    assert "the certificate its plugin ships" in status["message"]
    # the machine never ran the gates: its own folder stays empty
    assert not (tmp_path / "local").exists()
    # without the installed plugin's folder, nothing verifies it
    assert family_status(fam, shipped=[])["status"] == "not_verified"


def test_one_changed_character_of_the_template_makes_it_stale(installed: Path) -> None:
    fam = build("smollm2")
    changed = fam.replace_template(fam.template.replace("<|im_start|>", "<|im_start|> ", 1))
    status = family_status(changed)
    assert status["status"] == "stale", status
    assert status["changed"] == ["template"] and status["source"] == "shipped"
    assert "template changed" in status["message"]
    assert "miles family verify smollm2" in status["message"]


def test_damaged_or_foreign_shipped_files_certify_nothing(installed: Path) -> None:
    fam = build("smollm2")
    (cert,) = installed.glob("smollm2-*.json")
    body = json.loads(cert.read_text())
    cert.unlink()
    for name, bad in {
        "gates_text": {**body, "gates": "cpu engine"},
        "parts_list": {**body, "parts": ["template"]},
        "other_family": {**body, "family": "qwen3"},
    }.items():
        (installed / f"smollm2-{name}.json").write_text(json.dumps(bad))
    (installed / "smollm2-broken.json").write_text("{not json")
    assert load_certificates("smollm2", shipped=[installed]) == []
    assert family_status(fam)["status"] == "not_verified"
    # the well-formed one counts again
    cert.write_text(json.dumps(body))
    assert family_status(fam)["status"] == "verified"
