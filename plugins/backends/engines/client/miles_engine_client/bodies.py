"""The request bodies Miles's HTTP servers accept (the embedded engine, the diffusion engine, the
session server): bounded in size before they are read, bounded in nesting, valid text.

A body is untrusted input from whoever reaches the port. Three things about it would otherwise
reach a handler as a server error or an unbounded allocation:

* its size: a ``Content-Length`` over the endpoint's limit is refused from the header, before a
  byte of the body is read (aiohttp's ``client_max_size`` only stops a body once that much of it
  has been buffered), and a chunked body is cut off as soon as it passes the limit;
* its nesting: Python's JSON decoder recurses, so ``[[[[...]]]]`` a few thousand deep is a
  ``RecursionError``, and a few hundred deep passes the decoder only to recurse again in the
  validator or the encoder of the answer;
* its text: a JSON ``\\ud800`` escape decodes to a lone surrogate, a ``str`` that no encoder
  (a tokenizer, the UTF-8 of the answer) accepts.

Each is a :class:`BodyRejected` with a 4xx status and a message that names the limit.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

#: The deepest nesting of arrays and objects a body may have; SGLang's and OpenAI's bodies need
#: under ten levels.
MAX_JSON_DEPTH = 64


class BodyRejected(Exception):
    """A body refused before it reached a handler: answered with ``status`` (4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_declared_size(request: web.Request, limit: int) -> None:
    """Refuse (413) a request whose ``Content-Length`` is over ``limit`` bytes, from the header
    alone."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyRejected(
            413,
            f"the body of {request.path} is limited to {limit} bytes; "
            f"Content-Length says {declared}",
        )


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes: refused from the header when it declares more,
    and cut off with a 413 as soon as a chunked body passes the limit."""
    check_declared_size(request, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise BodyRejected(413, f"the body of {request.path} is limited to {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_tree(data: Any, max_depth: int) -> None:
    # Iterative, so a deep body cannot recurse here either.
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise BodyRejected(400, f"the JSON body nests deeper than {max_depth} levels")
            for key, value in node.items():
                _check_text(key)
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise BodyRejected(400, f"the JSON body nests deeper than {max_depth} levels")
            for value in node:
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1))
        elif isinstance(node, str):
            _check_text(node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyRejected(
            400, "the JSON body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text"
        ) from None


def loads(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` decoded as JSON: strict UTF-8, nested at most ``max_depth`` levels, every string
    valid text. Any failure is a :class:`BodyRejected` (400)."""
    try:
        # decoded here: json.loads would also take UTF-16 and UTF-32 bodies
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise BodyRejected(400, f"the JSON body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyRejected(400, f"the body is not valid JSON: {exc}") from None
    _check_tree(data, max_depth)
    return data


async def read_json(request: web.Request, limit: int, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`read_body` then :func:`loads`; an empty body is ``None``."""
    raw = await read_body(request, limit)
    if not raw.strip():
        return None
    return loads(raw, max_depth=max_depth)
