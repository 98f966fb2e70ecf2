"""Model-family gates: is a family's chat template append-only, and is it certified?

Pure Python over the :class:`miles_core.contracts.Family` protocol, reading nothing it does
not declare: no torch, no tokenizer library, no template engine is imported here; the family
brings its own.

* :func:`verify_family` runs the gates and writes a certificate on a pass;
* :func:`family_status` says whether a family is verified (both gates passed:
  :data:`REQUIRED_GATES`), stale or not verified, from the local certificates and those the
  installed plugins ship (:func:`shipped_certificate_dirs`);
* :func:`require_verified_family` builds a run's family and refuses it unless verified;
* :mod:`~miles_core.families.shapes` holds the conversation shapes the CPU gate renders
  (:data:`SHAPES`: the session shapes and the boundary shapes, where a turn's first token
  could merge with the text before it).
"""

from __future__ import annotations

from miles_core.families.certificate import (
    NOT_VERIFIED,
    REQUIRED_GATES,
    STALE,
    VERIFIED,
    certificate_dir,
    certificate_status,
    load_certificates,
    shipped_certificate_dirs,
    write_certificate,
)
from miles_core.families.cpu_gate import check_shape, cut_points, run_cpu_gate
from miles_core.families.report import GateFailure, GateReport
from miles_core.families.shapes import BASE_SHAPES, BOUNDARY_SHAPES, SHAPES, ConversationShape
from miles_core.families.verify import (
    AVAILABLE_GATES,
    UnverifiedFamilyError,
    family_status,
    require_verified_family,
    verify_family,
)

__all__ = [
    "AVAILABLE_GATES",
    "BASE_SHAPES",
    "BOUNDARY_SHAPES",
    "NOT_VERIFIED",
    "REQUIRED_GATES",
    "SHAPES",
    "STALE",
    "VERIFIED",
    "ConversationShape",
    "GateFailure",
    "GateReport",
    "UnverifiedFamilyError",
    "certificate_dir",
    "certificate_status",
    "check_shape",
    "cut_points",
    "family_status",
    "load_certificates",
    "require_verified_family",
    "run_cpu_gate",
    "shipped_certificate_dirs",
    "verify_family",
    "write_certificate",
]
