"""The functions ``miles family verify`` and ``miles family list`` call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from miles_core.families.certificate import certificate_status, write_certificate
from miles_core.families.cpu_gate import Boundaries, run_cpu_gate
from miles_core.families.report import GateFailure, GateReport
from miles_core.families.shapes import SHAPES, ConversationShape

#: The gates. ``cpu``: the template is append-only in text and tokens (pure Python, here).
#: ``engine``: a real model on a real engine drives a scripted session through the session
#: server; the family brings it as ``family.run_engine_gate(report, **engine_options)`` (it needs
#: torch and an engine, which the core does not import).
AVAILABLE_GATES = ("cpu", "engine")


def verify_family(
    family: Any,
    *,
    gates: Iterable[str] = ("cpu",),
    shapes: Iterable[ConversationShape] = SHAPES,
    boundaries: Boundaries = "turn",
    certificate_dir: Path | None = None,
    write: bool = True,
    engine_options: Mapping[str, Any] | None = None,
) -> GateReport:
    """Run ``gates`` on a built family; on a pass, write its certificate (unless ``write`` is
    False) and record the path in the returned report. A failed report names each failing
    shape, turn and first differing characters (``report.format()``). ``engine_options`` go to
    the family's engine gate (``engine_url``, ``model``...)."""
    gates = tuple(gates)
    unknown = [g for g in gates if g not in AVAILABLE_GATES]
    if unknown:
        raise ValueError(
            f"unknown or unavailable gate(s) {', '.join(unknown)}; available: "
            f"{', '.join(AVAILABLE_GATES)}"
        )
    if not gates:
        raise ValueError("no gate to run")
    report = GateReport(family=family.name, fingerprint=family.fingerprint(), gates=gates)
    if "cpu" in gates:
        run_cpu_gate(family, shapes, boundaries=boundaries, report=report)
    if "engine" in gates:
        runner = getattr(family, "run_engine_gate", None)
        if runner is None:
            report.failures.append(
                GateFailure(
                    "engine",
                    "scripted_session",
                    "family",
                    -1,
                    "",
                    f"family {family.name!r} has no engine gate (run_engine_gate)",
                )
            )
        else:
            runner(report, **dict(engine_options or {}))
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
