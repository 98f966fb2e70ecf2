"""Gate shapes beyond :data:`miles_core.families.SHAPES`: the upstream project's trajectories.

**Upstream trajectories** (:func:`upstream_shapes`). The multi-turn trajectories that the PyPI
package ``miles-tito-tokenizers`` tests its own templates with, read from the installed package
(a test extra of this distribution) and run as gate shapes.

The boundary shapes (a system message right before an assistant turn) are the core's
(:data:`miles_core.families.BOUNDARY_SHAPES`, part of ``SHAPES``): every family's CPU gate runs
them. The trajectories stay here: they need the test extra.
"""

from __future__ import annotations

from miles_core.families.shapes import ConversationShape


def upstream_shapes() -> tuple[ConversationShape, ...]:
    """The mock trajectories of ``miles-tito-tokenizers`` (every ``*Trajectory`` class its
    ``testing`` module exports: messages and tools as the package defines them) as gate shapes
    named ``tito_<ClassName>``. Raises ``RuntimeError`` naming the package when it is not
    installed (it is in this distribution's ``test`` extra)."""
    try:
        from miles_tito_tokenizers import testing  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "the upstream trajectories come from the miles-tito-tokenizers package: "
            "pip install 'miles-modelfamilies[test]' (or miles-tito-tokenizers)"
        ) from exc
    shapes = []
    for name in sorted(testing.__all__):
        if not name.endswith("Trajectory") or name == "Trajectory":
            continue
        cls = getattr(testing, name)
        tools = None if cls.TOOLS is None else tuple(cls.TOOLS)
        doc = (cls.__doc__ or name).strip()
        shapes.append(ConversationShape(f"tito_{name}", doc, tuple(cls.MESSAGES), tools))
    return tuple(shapes)
