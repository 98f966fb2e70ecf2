"""Malformed tool calls: generated calls whose arguments are not JSON or not what the tool's
schema asks for, and blocks the family's parser could not read at all.

Reported the way SGLang's and vLLM's OpenAI servers report them, and marked:

* a block that does not parse (its JSON is broken, so there is no name or arguments to read)
  stays in the reply's ``content`` as the model wrote it and is not a tool call;
* a call whose arguments are not a JSON object, or do not match the tool's schema (missing
  required keys, wrong types of top-level properties, keys the schema forbids) or names no
  offered tool, stays a tool call with ``arguments`` the string the model generated.

Each one is an entry of the turn's ``tool_call_errors`` (``index``/``id``/``name``/``arguments``
of the call, ``None`` for an unparsed block, and ``error``), answered as
``miles.tool_call_errors`` and counted as the session's ``malformed_tool_calls``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: JSON-schema type names and the Python types of parsed JSON values that satisfy them.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _type_ok(value: Any, expected: Any) -> bool:
    names = expected if isinstance(expected, list) else [expected]
    known = [n for n in names if isinstance(n, str) and n in _TYPES]
    if not known:
        return True  # a type this check does not know is not held against the call
    for name in known:
        if isinstance(value, bool) and name != "boolean":
            continue  # JSON true is not a number
        if name == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, _TYPES[name]):
            return True
    return False


def schema_errors(arguments: Mapping[str, Any], schema: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with parsed ``arguments`` for a tool whose parameters are ``schema``:
    missing required keys, top-level values of the wrong type, keys the schema forbids."""
    if not isinstance(schema, Mapping):
        return []
    errors: list[str] = []
    props = schema.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = schema.get("required")
    for key in required if isinstance(required, list) else ():
        if isinstance(key, str) and key not in arguments:
            errors.append(f"missing required argument {key!r}")
    for key, value in arguments.items():
        spec = props.get(key)
        if isinstance(spec, Mapping) and "type" in spec and not _type_ok(value, spec["type"]):
            errors.append(f"argument {key!r} is {type(value).__name__}, not {spec['type']}")
        elif spec is None and schema.get("additionalProperties") is False:
            errors.append(f"argument {key!r} is not in the schema")
    return errors


def call_error(call: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """Why a parsed tool call (OpenAI format) is malformed for the offered ``tools`` (OpenAI
    format), or ``None``."""
    function = call["function"]
    name, raw = function["name"], function.get("arguments", "")
    offered = {
        t["function"]["name"]: t["function"].get("parameters")
        for t in tools or ()
        if isinstance(t.get("function"), Mapping)
    }
    if name not in offered:
        return f"no tool named {name!r} was offered (tools: {', '.join(offered) or 'none'})"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        return f"the arguments are not valid JSON: {exc}"
    if not isinstance(arguments, dict):
        return f"the arguments are a JSON {type(arguments).__name__}, not an object"
    problems = schema_errors(arguments, offered[name])
    return "; ".join(problems) if problems else None


def malformed(
    calls: Sequence[Mapping[str, Any]],
    parse_errors: Sequence[str],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[dict[str, Any]]:
    """The ``tool_call_errors`` of a reply: its calls (with ids) that :func:`call_error`
    refuses, then the blocks the family's parser could not read (``parse_errors``)."""
    out: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        error = call_error(call, tools)
        if error is not None:
            function = call["function"]
            out.append(
                {
                    "index": i,
                    "id": call.get("id"),
                    "name": function["name"],
                    "arguments": function.get("arguments"),
                    "error": error,
                }
            )
    for error in parse_errors:
        out.append(
            {
                "index": None,
                "id": None,
                "name": None,
                "arguments": None,
                "error": f"a tool-call block did not parse (kept in the content): {error}",
            }
        )
    return out
