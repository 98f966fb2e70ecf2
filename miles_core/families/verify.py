"""The functions ``miles family verify`` and ``miles family list`` call."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles_core.families.certificate import certificate_status, write_certificate
from miles_core.families.cpu_gate import Boundaries, run_cpu_gate
from miles_core.families.report import GateReport
from miles_core.families.shapes import SHAPES, ConversationShape

#: Gates that can run on this machine. The engine gate (a real model on the real engine driving
#: a scripted session) is not implemented yet.
AVAILABLE_GATES = ("cpu",)


def verify_family(
    family: Any,
    *,
    gates: Iterable[str] = ("cpu",),
    shapes: Iterable[ConversationShape] = SHAPES,
    boundaries: Boundaries = "turn",
    certificate_dir: Path | None = None,
    write: bool = True,
) -> GateReport:
    """Run ``gates`` on a built family; on a pass, write its certificate (unless ``write`` is
    False) and record the path in the returned report. A failed report names each failing
    shape, turn and first differing characters (``report.format()``)."""
    gates = tuple(gates)
    unknown = [g for g in gates if g not in AVAILABLE_GATES]
    if unknown:
        raise ValueError(
            f"unknown or unavailable gate(s) {', '.join(unknown)}; available: "
            f"{', '.join(AVAILABLE_GATES)} (the engine gate is not implemented yet)"
        )
    if not gates:
        raise ValueError("no gate to run")
    report = GateReport(family=family.name, fingerprint=family.fingerprint(), gates=gates)
    run_cpu_gate(family, shapes, boundaries=boundaries, report=report)
    if report.passed and write:
        report.certificate = str(write_certificate(family, report, certificate_dir))
    return report


def family_status(family: Any, *, certificate_dir: Path | None = None) -> dict[str, Any]:
    """JSON-ready status of a built family (``miles family list --json``): name, fingerprint,
    ``status`` in verified / stale / not_verified, the certificate path, and a message."""
    out = certificate_status(family, certificate_dir)
    for attr in ("description", "stop_tokens", "roles", "thinking"):
        value = getattr(family, attr, None)
        if value is not None:
            out[attr] = list(value) if isinstance(value, (tuple, list, set)) else value
    return out
