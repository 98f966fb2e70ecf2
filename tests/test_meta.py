"""Meta-tests: the hook reference is complete and current, and every hook has a test."""

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
