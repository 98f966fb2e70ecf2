"""The functions ``miles family verify``, ``miles family list`` and a run call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_core.contracts import Family
from miles_core.errors import MilesUserError
from miles_core.families.certificate import (
    REQUIRED_GATES,
    VERIFIED,
    certificate_status,
    write_certificate,
)
from miles_core.families.cpu_gate import Boundaries, run_cpu_gate
from miles_core.families.report import GateReport
from miles_core.families.shapes import SHAPES, ConversationShape

#: The gates. ``cpu``: the template is append-only in text and tokens (pure Python, here).
#: ``engine``: a real model on a real engine drives a scripted session through the family's stop
#: tokens and parsers; the family brings it as ``family.run_engine_gate(report,
#: **engine_options)`` (it needs torch and an engine, which the core does not import; a family
#: on :class:`~miles_core.contracts.FamilyDefaults` without one fails this gate). A family
#: is verified when both passed (:data:`~miles_core.families.certificate.REQUIRED_GATES`).
AVAILABLE_GATES = ("cpu", "engine")


def verify_family(
    family: Family,
    *,
    gates: Iterable[str] = REQUIRED_GATES,
    shapes: Iterable[ConversationShape] = SHAPES,
    boundaries: Boundaries = "turn",
    certificate_dir: Path | None = None,
    write: bool = True,
    engine_options: Mapping[str, Any] | None = None,
) -> GateReport:
    """Run ``gates`` (by default both, which is what verifies a family) on a built family; on a
    pass, write its certificate (unless ``write`` is False) and record the path in the returned
    report. A failed report names each failing shape, turn and first differing characters
    (``report.format()``). ``engine_options`` go to the family's engine gate (``url``,
    ``model``...: the family's plugin defines them)."""
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
        family.run_engine_gate(report, **dict(engine_options or {}))
    if report.passed and write:
        report.certificate = str(write_certificate(family, report, certificate_dir))
    return report


def family_status(
    family: Family,
    *,
    certificate_dir: Path | None = None,
    shipped: Sequence[Path] | None = None,
) -> dict[str, Any]:
    """JSON-ready status of a built family (``miles family list --json``): name, fingerprint,
    ``status`` in verified / stale / not_verified, the certificate path and its ``source``
    (``local``, or ``shipped`` by a plugin), and a message. ``shipped``: the folders of shipped
    certificates (default: those of the installed plugins)."""
    out = certificate_status(family, certificate_dir, shipped=shipped)
    out.update(
        description=family.description,
        stop_tokens=list(family.stop_tokens),
        roles=list(family.roles),
        thinking=family.thinking,
    )
    return out


class UnverifiedFamilyError(MilesUserError):
    """The run's model family has no certificate of both gates for its current fingerprint;
    ``status`` is its :func:`family_status`."""

    def __init__(self, message: str, status: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status


def require_verified_family(
    config: Any, registry: Any, *, certificate_dir: Path | None = None
) -> Any:
    """Build the run's model family and refuse it unless it is verified.

    ``config`` is a validated :class:`miles_core.config.RunConfig` (its ``model.family``
    selection and ``model.accept_unverified_family``), ``registry`` the plugins' registry.
    Returns the built family (``None`` when the run names none); with
    ``accept_unverified_family: true`` an unverified family is returned too. Raises
    :class:`UnverifiedFamilyError` (a user error: exit code 2, no traceback) naming the family,
    its status and the command that verifies it, or a :class:`MilesUserError` naming the family
    and its distribution when it cannot be built. Call it before any device work starts.
    """
    from miles_core.components import Kind

    selection = config.model.family
    if selection is None:
        return None
    name = selection.name
    try:
        family = registry.get(Kind.MODEL_FAMILY, name).build(selection.options)
    except MilesUserError:
        raise
    except Exception as exc:  # a family that cannot load its tokenizer or template
        owner = registry.owner(Kind.MODEL_FAMILY, name).distribution
        raise MilesUserError(
            f"model family {name!r} (from {owner}) could not be built: {exc}"
        ) from None
    if config.model.accept_unverified_family:
        return family
    status = family_status(family, certificate_dir=certificate_dir)
    if status["status"] != VERIFIED:
        raise UnverifiedFamilyError(
            f"model.family {name!r} is {status['status'].replace('_', ' ')}"
            f" ({status.get('message', 'no certificate')}): its chat template and parsers have "
            f"not passed the {' and '.join(REQUIRED_GATES)} gates. Run `miles family verify "
            f"{name}`, or set model.accept_unverified_family: true to accept the risk of "
            "training on tokens that differ from what the engine generated.",
            status,
        )
    return family
