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

**Certificates that travel.** A plugin may ship its maintainer's certificates as package data:
the files ``miles family verify`` wrote, in a folder ``certificates/`` of the package an entry
point of the group ``miles`` names (:func:`shipped_certificate_dirs`). They are read beside the
local ones, and count the same way: only for the family they name at the fingerprint they
record, so a user of a published family is verified without its model as long as the
installed template, tokenizer and parsers are the ones the maintainer verified; one changed
character makes the family ``stale``, naming the part that changed. Nothing a certificate holds
runs: it is JSON, compared field by field.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_core.contracts import Family
from miles_core.families.report import GateReport

FORMAT_VERSION = 1
VERIFIED, STALE, NOT_VERIFIED = "verified", "stale", "not_verified"
#: The gates a certificate must record for its family to count as verified.
REQUIRED_GATES = ("cpu", "engine")
#: The folder of a plugin's package holding the certificates it ships.
SHIPPED_FOLDER = "certificates"


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


def shipped_certificate_dirs() -> list[Path]:
    """The folders of certificates installed plugins ship: ``certificates/`` in the top-level
    package of every module an entry point of the group ``miles`` names. Finding a package's
    folder imports nothing of it."""
    from importlib import metadata, util

    from miles_core.plugins import ENTRY_POINT_GROUP

    seen: set[str] = set()
    out: list[Path] = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        top = entry.module.split(".", 1)[0]
        if top in seen:
            continue
        seen.add(top)
        try:
            spec = util.find_spec(top)
        except (ImportError, ValueError):  # a broken plugin is reported where it loads
            continue
        for location in (spec.submodule_search_locations or ()) if spec else ():
            folder = Path(location) / SHIPPED_FOLDER
            if folder.is_dir():
                out.append(folder)
    return out


def _well_formed(body: Any, name: str) -> bool:
    """Whether ``body`` is a certificate of ``name`` with the fields the status reads, of the
    types it reads them as (a damaged or foreign file certifies nothing)."""
    return (
        isinstance(body, dict)
        and body.get("family") == name
        and isinstance(body.get("fingerprint"), str)
        and bool(body["fingerprint"])
        and isinstance(body.get("gates", []), list)
        and all(isinstance(g, str) for g in body.get("gates", []))
        and isinstance(body.get("parts", {}), dict)
    )


def load_certificates(
    name: str, directory: Path | None = None, *, shipped: Sequence[Path] = ()
) -> list[dict[str, Any]]:
    """Every readable certificate of family ``name`` in ``directory`` (default:
    :func:`certificate_dir`) and in the ``shipped`` folders, newest first; each with its
    ``path`` and ``source`` (``local`` or ``shipped``)."""
    found = []
    folders = [(directory or certificate_dir(), "local"), *((f, "shipped") for f in shipped)]
    for folder, source in folders:
        for path in sorted(folder.glob(f"{name}-*.json")) if folder.is_dir() else []:
            try:
                body = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a damaged file certifies nothing
            if _well_formed(body, name):
                body["path"], body["source"] = str(path), source
                found.append(body)
    return sorted(found, key=lambda b: str(b.get("verified_at", "")), reverse=True)


def certificate_status(
    family: Family, directory: Path | None = None, *, shipped: Sequence[Path] | None = None
) -> dict[str, Any]:
    """JSON-ready status of ``family``: ``verified``, ``stale`` (with what changed) or
    ``not_verified``, from the local certificates and those plugins ship (``shipped``: the
    folders to read; default :func:`shipped_certificate_dirs`)."""
    name = family.name
    fingerprint = family.fingerprint()
    folders = shipped_certificate_dirs() if shipped is None else shipped
    certificates = load_certificates(name, directory, shipped=folders)
    out: dict[str, Any] = {"name": name, "fingerprint": fingerprint}
    # Both gates must have passed for this fingerprint: the CPU gate alone does not show the
    # family on a real engine, the engine gate alone covers one conversation, not the shapes.
    same = [c for c in certificates if c["fingerprint"] == fingerprint]
    match = next((c for c in same if set(REQUIRED_GATES) <= set(c.get("gates") or ())), None)
    if match is not None:
        out.update(
            status=VERIFIED,
            certificate=match["path"],
            source=match["source"],
            gates=match.get("gates", []),
            verified_at=match.get("verified_at"),
            message=f"verified by the {'+'.join(match.get('gates', []))} gate"
            + (" (the certificate its plugin ships)" if match["source"] == "shipped" else ""),
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
            source=latest["source"],
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
