"""Error lines of a run config: one per problem, naming the field's path and what is allowed."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def _loc(prefix: str, loc: Iterable[Any]) -> str:
    parts = [prefix] if prefix else []
    parts += [f"[{p}]" if isinstance(p, int) else str(p) for p in loc]
    return ".".join(parts).replace(".[", "[")


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return current if isinstance(current, type) else None


def format_validation_error(exc: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    """One line per pydantic error: the field path, what is wrong, what is allowed."""
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        path = _loc(prefix, loc)
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent else "see `miles config schema`"
            lines.append(f"{path}: unknown key {loc[-1]!r}; allowed: {allowed}")
        elif kind == "missing":
            lines.append(f"{path}: required field missing")
        else:
            got = err.get("input")
            lines.append(f"{path}: {err.get('msg')} (got {json.dumps(got, default=str)})")
    return lines
