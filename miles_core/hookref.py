"""Renders the hook reference (``docs/hooks.md``) from :mod:`miles_core.hookspecs`.

Run ``python -m miles_core.hookref > docs/hooks.md`` after changing a hookspec; a test fails
while the file and the specs disagree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from miles_core import hookspecs


def hookspec_functions() -> list[Callable[..., Any]]:
    """The hookspecs, in the order the module defines them."""
    fns = [
        obj
        for name, obj in vars(hookspecs).items()
        if name.startswith("miles_") and inspect.isfunction(obj)
    ]
    return sorted(fns, key=lambda f: f.__code__.co_firstlineno)


def signature(fn: Callable[..., Any]) -> str:
    """``def name(param: Type, ...) -> None`` exactly as declared."""
    params = []
    for p in inspect.signature(fn).parameters.values():
        params.append(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name)
    ret = inspect.signature(fn).return_annotation
    return f"def {fn.__name__}({', '.join(params)}) -> {ret}"


def render() -> str:
    """The whole hook reference as Markdown."""
    out = [
        "# Hook reference",
        "",
        "Generated from `miles_core/hookspecs.py` by `python -m miles_core.hookref`; do not edit.",
        "Implement a hook with `from miles_core import hookimpl`. Registration hooks receive a",
        "`register` callback taking a record from `miles_core.components`; lifecycle hooks are",
        "called by the loop and their return values are ignored.",
        "",
    ]
    for fn in hookspec_functions():
        opts = getattr(fn, "miles_spec", {}) or {}
        out += [f"## `{fn.__name__}`", "", "```python", signature(fn), "```", ""]
        if opts.get("historic"):
            out += ["*historic*: plugins registered later still receive earlier calls.", ""]
        if opts.get("firstresult"):
            out += ["*firstresult*: the first plugin answer that is not None wins.", ""]
        out += [inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
