"""Meta-tests: the hook reference is complete and current, every hook has a test, and the
core's classes stay small."""

from __future__ import annotations

import re
from pathlib import Path

from miles_core import hookref

REPO = Path(__file__).resolve().parents[1]


def test_every_hookspec_is_in_the_reference_with_its_exact_signature():
    doc = (REPO / "docs" / "hooks.md").read_text()
    for fn in hookref.hookspec_functions():
        assert hookref.signature(fn) in doc, f"{fn.__name__} missing or stale in docs/hooks.md"
    assert doc == hookref.render(), "docs/hooks.md is stale: python -m miles_core.hookref"


def test_every_hookspec_has_a_test():
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    defined = set(re.findall(r"^def (test_hook_\w+)\(", tests, flags=re.M))
    for fn in hookref.hookspec_functions():
        assert f"test_hook_{fn.__name__}" in defined, f"no test_hook_{fn.__name__}"


def test_contributing_links_the_hook_reference():
    assert "docs/hooks.md" in (REPO / "CONTRIBUTING.md").read_text()


def test_no_class_in_the_core_is_over_300_lines():
    """The runtime is composed of parts that each own one concept; a class that grows past
    300 lines is doing two jobs."""
    import ast

    import miles_core

    big = []
    for path in Path(miles_core.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= 300:
                big.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not big, big
