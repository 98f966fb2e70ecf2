"""What a gate run found: a :class:`GateReport` of :class:`GateFailure` entries, readable as text
(``miles family verify``) and as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Characters shown on each side of the first difference.
CONTEXT_CHARS = 40


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (the shorter length when one is
    a prefix of the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def show_difference(label_a: str, a: str, label_b: str, b: str, at: int) -> str:
    """Two lines quoting ``a`` and ``b`` around character ``at``, the difference marked ``▶``."""
    width = max(len(label_a), len(label_b))
    return "\n".join(
        f"    {label.ljust(width)}: {quote_at(text, at)}"
        for label, text in ((label_a, a), (label_b, b))
    )


def quote_at(text: str, at: int) -> str:
    """``…'before' ▶ 'after'…``: the text around character ``at``, quoted with escapes visible."""
    start = max(0, at - CONTEXT_CHARS)
    before = ("…" if start else "") + repr(text[start:at])
    if at >= len(text):
        return f"{before} ▶ <end of text>"
    tail = "…" if at + CONTEXT_CHARS < len(text) else ""
    return f"{before} ▶ {text[at : at + CONTEXT_CHARS]!r}{tail}"


@dataclass
class GateFailure:
    """One violated property.

    Attributes:
        gate: the gate that found it (``cpu``).
        shape: the conversation shape.
        check: ``prefix`` (a prefix render is not a prefix of the whole), ``generation_prompt``
            (the generation prompt is not where the assistant turn starts), ``tokens`` (the
            incremental tokens differ from the canonical ones), ``parse`` (parsing an assistant
            turn's text does not give the turn back), ``render`` (the template raised) or
            ``family`` (the family lacks what the gate needs).
        turn: index of the message the failure is attributed to (-1 when none).
        role: that message's role.
        detail: readable explanation, quoting the first differing characters.
    """

    gate: str
    shape: str
    check: str
    turn: int
    role: str
    detail: str

    def format(self) -> str:
        """``shape 'x', turn 3 (assistant), prefix check: ...``"""
        where = f"turn {self.turn} ({self.role})" if self.turn >= 0 else "whole conversation"
        return f"- shape {self.shape!r}, {where}, {self.check} check: {self.detail}"


@dataclass
class GateReport:
    """Outcome of :func:`miles_core.families.verify_family`.

    Attributes:
        family: the family name.
        fingerprint: the fingerprint the gates ran against (what a certificate binds to).
        gates: the gates that ran.
        shapes: names of the conversation shapes checked.
        skipped: shape name -> why it was not applicable to this family.
        checks: how many individual comparisons ran.
        failures: every violated property (empty when passed).
        certificate: path of the certificate written on a pass, else ``None``.
        details: per gate, what it measured beyond pass/fail (the engine gate: model, turns,
            assistant-text drift counts and differences).
    """

    family: str
    fingerprint: str
    gates: tuple[str, ...]
    shapes: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    checks: int = 0
    failures: list[GateFailure] = field(default_factory=list)
    certificate: str | None = None
    seconds: float = 0.0
    details: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every gate ran and nothing failed."""
        return not self.failures and bool(self.shapes)

    def add_failure(
        self, gate: str, shape: str, check: str, detail: str, *, turn: int = -1, role: str = ""
    ) -> None:
        """Record one violated property (a :class:`GateFailure`)."""
        self.failures.append(GateFailure(gate, shape, check, turn, role, detail))

    def failed_shapes(self) -> list[str]:
        """Shapes with at least one failure, in order."""
        return list(dict.fromkeys(f.shape for f in self.failures))

    def format(self) -> str:
        """Readable multi-line summary, printed by ``miles family verify``."""
        gates = "+".join(self.gates)
        head = (
            f"family {self.family!r} {'PASSED' if self.passed else 'FAILED'} the {gates} gate: "
            f"{len(self.shapes) - len(self.failed_shapes())}/{len(self.shapes)} conversation "
            f"shapes passed, {self.checks} checks, {self.seconds:.2f} s "
            f"(fingerprint {self.fingerprint[:16]})"
        )
        lines = [head]
        lines += [f.format() for f in self.failures]
        engine = self.details.get("engine")
        if engine:
            lines.append(
                f"  engine gate: model {engine.get('model')}"
                + (" (scripted)" if engine.get("scripted") else "")
                + (f" on {engine['engine_url']}" if engine.get("engine_url") else "")
                + (f" ({engine['rollout_engine']} engine)" if engine.get("rollout_engine") else "")
                + f", {engine.get('turns', 0)} turns, rollbacks {engine.get('rollbacks', 0)}, "
                f"tool calls from the engine {engine.get('engine_tool_calls', 0)}, "
                f"assistant-text drift in {engine.get('text_drift_turns', 0)} turn(s), "
                f"token drift in {engine.get('token_drift_turns', 0)}"
            )
            if engine.get("note"):
                lines.append(f"    note: {engine['note']}")
            for drift in engine.get("drift", [])[:3]:
                lines.append("    drift " + str(drift).replace("\n", "\n    "))
        for name, why in self.skipped.items():
            lines.append(f"  skipped shape {name!r}: {why}")
        if self.certificate:
            lines.append(f"  certificate: {self.certificate}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``miles family verify --json``)."""
        return {
            "family": self.family,
            "passed": self.passed,
            "fingerprint": self.fingerprint,
            "gates": list(self.gates),
            "shapes": list(self.shapes),
            "skipped": dict(self.skipped),
            "checks": self.checks,
            "failures": [asdict(f) for f in self.failures],
            "certificate": self.certificate,
            "seconds": round(self.seconds, 3),
            "details": self.details,
        }
