"""Meta-tests: the hook reference is complete and current, every hook has a test, the core's
and the plugins' modules, functions and classes stay under their size limits, and the core and
the family gates do not sniff (each checker is also shown to fail on a made-up violation)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from miles_core import hookref

REPO = Path(__file__).resolve().parents[1]


def _parse(source: str) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's spurious ``SystemError: AST constructor
    recursion depth mismatch`` (CPython issue 106905): its AST builder keeps one depth
    counter for the interpreter, and a thread that builds an AST meanwhile (one an earlier
    test left in this pytest worker) can make a correct parse raise it once."""
    for attempt in range(5):
        try:
            return ast.parse(source)
        except SystemError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def test_every_hookspec_is_in_the_reference_with_its_exact_signature():
    doc = (REPO / "docs" / "hooks.md").read_text()
    for fn in hookref.hookspec_functions():
        assert hookref.signature(fn) in doc, f"{fn.__name__} missing or stale in docs/hooks.md"
    assert doc == hookref.render(), "docs/hooks.md is stale: python -m miles_core.hookref"


def test_every_hookspec_has_a_test():
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    defined = set(re.findall(r"^def (test_hook_\w+)\(", tests, flags=re.M))
    for fn in hookref.hookspec_functions():
        assert f"test_hook_{fn.__name__}" in defined, f"no test_hook_{fn.__name__}"


def test_contributing_links_the_hook_reference():
    assert "docs/hooks.md" in (REPO / "CONTRIBUTING.md").read_text()


def test_no_class_in_the_core_is_over_300_lines():
    """The runtime is composed of parts that each own one concept; a class that grows past
    300 lines is doing two jobs."""
    import miles_core

    big = []
    for path in Path(miles_core.__file__).parent.rglob("*.py"):
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= 300:
                big.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not big, big


# --- Size rules -------------------------------------------------------------------------------
# A module, function or class past its limit is doing more than one job. The rules cover the
# core and every plugin's sources (tests and benchmarks aside); what still exceeds is named in
# SIZE_EXCEPTIONS with the reason, and an entry that no longer exceeds fails the test too, so
# the list only shrinks.

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300

#: "path" (a module) or "path::Qualified.name" (a function or class) -> why it may exceed.
SIZE_EXCEPTIONS: dict[str, str] = {}

#: folders whose Python files are not sources of a distribution
_NOT_SOURCES = {"tests", "benchmarks", "build", "__pycache__"}


def _scoped(tree: ast.AST, scope: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every node below ``tree`` with the qualified name of the function or class that
    encloses it (a definition is paired with its own name; ``""``: the module's level)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{scope}.{child.name}" if scope else child.name
            yield name, child
            yield from _scoped(child, name)
        else:
            yield scope, child
            yield from _scoped(child, scope)


def size_violations(source: str, path: str) -> dict[str, str]:
    """The size rules ``source`` (the file ``path``) breaks: allow-list key -> what exceeds."""
    found: dict[str, str] = {}
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found[path] = f"module of {lines} lines (max {MAX_MODULE_LINES})"
    for name, node in _scoped(_parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            what, limit = (
                ("class", MAX_CLASS_LINES)
                if isinstance(node, ast.ClassDef)
                else ("function", MAX_FUNCTION_LINES)
            )
            if length > limit:
                found[f"{path}::{name}"] = f"{what} of {length} lines (max {limit})"
    return found


def _sources() -> list[Path]:
    """The core's modules and every plugin's sources (not their tests, benchmarks or builds)."""
    plugins = []
    for path in (REPO / "plugins").rglob("*.py"):
        parts = path.relative_to(REPO).parts
        hidden = any(part.startswith(".") or part.endswith(".egg-info") for part in parts)
        if not hidden and not _NOT_SOURCES.intersection(parts):
            plugins.append(path)
    return sorted([*(REPO / "miles_core").rglob("*.py"), *plugins])


def unexplained(found: dict[str, str], allowed: dict[str, str]) -> list[str]:
    """What breaks a rule without an allow-list entry, then each entry that matches nothing
    (stale: remove it)."""
    new = [f"{key}: {what}" for key, what in sorted(found.items()) if key not in allowed]
    stale = [f"{key}: stale allow-list entry, remove it" for key in allowed if key not in found]
    return new + stale


def test_modules_functions_and_classes_stay_under_their_size_limits():
    found: dict[str, str] = {}
    for path in _sources():
        found.update(size_violations(path.read_text(), path.relative_to(REPO).as_posix()))
    assert not unexplained(found, SIZE_EXCEPTIONS), "\n".join(unexplained(found, SIZE_EXCEPTIONS))


def test_the_size_check_catches_a_made_up_violation():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"class Small:\n    def long(self):\n{body}\n\ndef short():\n    return 1\n"
    assert size_violations(source, "m.py") == {
        "m.py::Small.long": f"function of {MAX_FUNCTION_LINES + 1} lines (max 80)"
    }
    big = "class Big:\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert set(size_violations(big, "m.py")) == {"m.py::Big"}
    module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert set(size_violations(module, "m.py")) == {"m.py"}
    assert size_violations("x = 1\n" * MAX_MODULE_LINES, "m.py") == {}
    # an allowed violation passes; an entry that matches nothing is reported
    found = size_violations(source, "m.py")
    assert unexplained(found, {"m.py::Small.long": "why"}) == []
    assert unexplained({}, {"m.py::Small.long": "why"}) == [
        "m.py::Small.long: stale allow-list entry, remove it"
    ]


# --- No sniffing ------------------------------------------------------------------------------
# The core and the model-family gates call only what the contracts declare: no attribute
# forwarding (`__getattr__`), no probing an object for an attribute (`hasattr`, `getattr` with
# a literal name or a default), and no branching on a component's name. What remains is in
# SNIFF_EXCEPTIONS, keyed "path::scope" (the enclosing function or class, "<module>" at the
# top), with the reason; a stale entry fails.

#: "path::scope" -> why the probes in that scope are fine.
SNIFF_EXCEPTIONS: dict[str, str] = {
    "miles_core/builtins/data_sources.py::load_function": (
        "resolves the user's 'module:attr' string: a missing attribute is the user's error"
    ),
    "miles_core/config/formatting.py::_model_at": (
        "walks pydantic annotations (model_fields, typing __args__) to name an error's field"
    ),
    "miles_core/hookref.py::render": "pluggy's own marker attribute on a hookspec function",
    "miles_core/invariant/kernels.py::prepare": (
        "sets transformers' experts implementation on the modules of a Hugging Face model"
    ),
    "miles_core/testing/engine_contract.py::expect_4xx": (
        "the contract suite runs against any plugin's client, whose error type it cannot import"
    ),
}


def _sniff_files() -> list[Path]:
    gates = (REPO / "plugins" / "modelfamilies" / "miles_modelfamilies").glob("*gate*.py")
    return sorted([*(REPO / "miles_core").rglob("*.py"), *gates])


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _names_a_component(node: ast.Compare) -> bool:
    """``x.name == "grpo"``, ``x.name != "..."``, ``x.name in ("a", "b")`` and mirrored."""
    sides = [node.left, *node.comparators]
    literal = any(
        _is_str(s)
        or (
            isinstance(s, (ast.Tuple, ast.List, ast.Set))
            and s.elts
            and all(_is_str(e) for e in s.elts)
        )
        for s in sides
    )
    return literal and any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)


def sniff_violations(source: str, path: str) -> dict[str, str]:
    """The sniffing in ``source`` (the file ``path``): "path::scope" -> what is done there."""
    found: dict[str, list[str]] = {}
    for scope, node in _scoped(_parse(source)):
        what = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__":
            what = "defines __getattr__"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            probe = node.func.id == "hasattr" or (
                node.func.id == "getattr"
                and (len(node.args) > 2 or (len(node.args) > 1 and _is_str(node.args[1])))
            )
            what = ast.unparse(node) if probe else None
        elif isinstance(node, ast.Compare) and _names_a_component(node):
            what = ast.unparse(node)
        if what is not None:
            found.setdefault(f"{path}::{scope or '<module>'}", []).append(what)
    return {key: "; ".join(whats) for key, whats in found.items()}


def test_no_sniffing_in_the_core_or_the_family_gates():
    found: dict[str, str] = {}
    for path in _sniff_files():
        found.update(sniff_violations(path.read_text(), path.relative_to(REPO).as_posix()))
    problems = unexplained(found, SNIFF_EXCEPTIONS)
    assert not problems, "\n".join(problems)


def test_the_sniffing_check_catches_made_up_violations():
    source = (
        "class Proxy:\n"
        "    def __getattr__(self, name):\n"
        "        return 1\n"
        "def run(engine, algo, options, key):\n"
        "    if hasattr(engine, 'pause'):\n"
        "        engine.pause()\n"
        "    fast = getattr(engine, 'fast', False)\n"
        "    if algo.name == 'grpo' or 'ppo' != algo.name or algo.name in ('a', 'b'):\n"
        "        return getattr(options, key)\n"
        "    return getattr(options, key, None)\n"
        "getattr(options, 'x')\n"
    )
    found = sniff_violations(source, "m.py")
    assert found == {
        "m.py::Proxy.__getattr__": "defines __getattr__",
        "m.py::run": "; ".join(
            [
                "hasattr(engine, 'pause')",
                "getattr(engine, 'fast', False)",
                "algo.name == 'grpo'",
                "'ppo' != algo.name",
                "algo.name in ('a', 'b')",
                "getattr(options, key, None)",
            ]
        ),
        "m.py::<module>": "getattr(options, 'x')",
    }
    # what is not sniffing: reading a field by a computed name, comparing names with a name
    assert sniff_violations("getattr(o, key)\nx = a.name == b.name\n", "m.py") == {}
    assert unexplained(found, {}) and not unexplained(found, dict.fromkeys(found, "why"))
