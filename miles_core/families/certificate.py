"""Gate certificates: a passed gate leaves a JSON file bound to the family's fingerprint.

A certificate names the family, the fingerprint it was verified against (a hash over template
text, template arguments, tokenizer files and parser source) and the hash of each part the
family declares, so a stale certificate can say *what* changed. Certificates live in one
folder, ``~/.cache/miles/certificates/`` unless ``MILES_CERT_DIR`` says otherwise, one file per
(family, fingerprint): verifying two configurations of one family (thinking on and off) keeps
both.

A family's status is ``verified`` (a certificate matches its current fingerprint and records
both the CPU gate and the engine gate: :data:`REQUIRED_GATES`), ``stale`` (certificates exist
for its name, none for this fingerprint: something changed since) or ``not_verified`` (none,
or only one gate passed). A gate run later for the same fingerprint adds its gate to the
certificate, so the two gates may pass in separate runs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_core.contracts import Family
from miles_core.families.report import GateReport

FORMAT_VERSION = 1
VERIFIED, STALE, NOT_VERIFIED = "verified", "stale", "not_verified"
#: The gates a certificate must record for its family to count as verified.
REQUIRED_GATES = ("cpu", "engine")


def certificate_dir() -> Path:
    """The certificate folder: ``$MILES_CERT_DIR`` or ``~/.cache/miles/certificates``."""
    env = os.environ.get("MILES_CERT_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "miles" / "certificates"


def certificate_path(name: str, fingerprint: str, directory: Path | None = None) -> Path:
    """Where the certificate of ``name`` at ``fingerprint`` is written."""
    return (directory or certificate_dir()) / f"{name}-{fingerprint[:16]}.json"


def fingerprint_parts(family: Family) -> dict[str, str]:
    """The per-part hashes of the family's ``fingerprint_parts()`` (``{}``: none)."""
    return dict(family.fingerprint_parts())


def write_certificate(family: Family, report: GateReport, directory: Path | None = None) -> Path:
    """Write the certificate of a passed report; refuses a failed one."""
    if not report.passed:
        raise ValueError(f"family {report.family!r} did not pass its gates; no certificate")
    fingerprint = family.fingerprint()
    if fingerprint != report.fingerprint:
        raise ValueError(
            f"family {report.family!r} changed while its gates ran (fingerprint "
            f"{report.fingerprint[:16]} -> {fingerprint[:16]}); verify it again"
        )
    path = certificate_path(report.family, fingerprint, directory)
    # A gate run later for the same fingerprint adds to the certificate: an engine-gate pass
    # is kept when the CPU gate runs again, and the other way round.
    gates, details = list(report.gates), dict(report.details)
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = {}
    if isinstance(before, dict) and before.get("fingerprint") == fingerprint:
        gates = sorted({*(before.get("gates") or []), *gates}, key=lambda g: (g != "cpu", g))
        for gate, value in (before.get("details") or {}).items():
            details.setdefault(gate, value)
    body = {
        "format": FORMAT_VERSION,
        "family": report.family,
        "fingerprint": fingerprint,
        "parts": fingerprint_parts(family),
        "gates": gates,
        "details": details,
        "shapes": list(report.shapes),
        "skipped": dict(report.skipped),
        "checks": report.checks,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a reader never sees half a certificate.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_certificates(name: str, directory: Path | None = None) -> list[dict[str, Any]]:
    """Every readable certificate of family ``name``, newest first (each with its ``path``)."""
    folder = directory or certificate_dir()
    found = []
    for path in sorted(folder.glob(f"{name}-*.json")) if folder.is_dir() else []:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a damaged file certifies nothing
        if isinstance(body, dict) and body.get("family") == name and body.get("fingerprint"):
            body["path"] = str(path)
            found.append(body)
    return sorted(found, key=lambda b: str(b.get("verified_at", "")), reverse=True)


def certificate_status(family: Family, directory: Path | None = None) -> dict[str, Any]:
    """JSON-ready status of ``family``: ``verified``, ``stale`` (with what changed) or
    ``not_verified``."""
    name = family.name
    fingerprint = family.fingerprint()
    certificates = load_certificates(name, directory)
    out: dict[str, Any] = {"name": name, "fingerprint": fingerprint}
    # Both gates must have passed for this fingerprint: the CPU gate alone does not show the
    # family on a real engine, the engine gate alone covers one conversation, not the shapes.
    same = [c for c in certificates if c["fingerprint"] == fingerprint]
    match = next((c for c in same if set(REQUIRED_GATES) <= set(c.get("gates") or ())), None)
    if match is not None:
        out.update(
            status=VERIFIED,
            certificate=match["path"],
            gates=match.get("gates", []),
            verified_at=match.get("verified_at"),
            message=f"verified by the {'+'.join(match.get('gates', []))} gate",
        )
        return out
    if same:
        passed = list(same[0].get("gates") or [])
        missing = [g for g in REQUIRED_GATES if g not in passed]
        out.update(
            status=NOT_VERIFIED,
            certificate=same[0]["path"],
            gates=passed,
            missing_gates=missing,
            message=f"only the {'+'.join(passed)} gate passed, not the "
            f"{'+'.join(missing)} gate; run `miles family verify {name}`",
        )
        return out
    if certificates:
        latest = certificates[0]
        now = fingerprint_parts(family)
        before = latest.get("parts") or {}
        changed = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
        out.update(
            status=STALE,
            certificate=latest["path"],
            certified_fingerprint=latest["fingerprint"],
            changed=changed,
            message=(
                "certificate is stale: "
                + (f"{', '.join(changed)} changed" if changed else "the fingerprint changed")
                + f" since it was verified; run `miles family verify {name}`"
            ),
        )
        return out
    out.update(
        status=NOT_VERIFIED,
        certificate=None,
        message=f"not verified; run `miles family verify {name}`",
    )
    return out
