"""What every route group of an engine server shares: the error answers, the body limits,
the validated body, and the application built from the groups' route tables.

A route group is an object whose ``routes()`` lists :class:`Route` entries, each naming the
group's method that serves it; :func:`build_app` mounts the routes of every group it is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from aiohttp import web
from miles_engine_client.bodies import BodyRejected, check_declared_size, loads, read_body
from pydantic import BaseModel, ValidationError

from miles_core.hosts import api_key
from miles_engine_embedded.auth import api_key_middleware
from miles_engine_embedded.engine import EngineError

log = logging.getLogger("miles_engine_embedded")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The body limit of an endpoint without one of its own (the control endpoints: pause, abort,
#: flush, version, init group... whose bodies are a few fields).
CONTROL_BODY_LIMIT = 64 << 10
#: ``/generate``: a batch of token ids or text as JSON, a few bytes a token (a 16-request
#: batch of 32k-token prompts is about 6 MiB of decimal ids).
GENERATE_BODY_LIMIT = 16 << 20
#: The weight-update and adapter endpoints by default (``--max-weights-body-mb``): their bodies
#: carry shared-memory handles and a manifest, about 200 bytes of JSON a tensor (the colocated
#: transport, measured), so a bucket of 20,000 tensors for 8 ranks fits with margin.
WEIGHTS_BODY_LIMIT = 256 << 20
#: ``app[BODY_LIMITS]``: ``{path: bytes}``, each endpoint's body limit (else the control one)
BODY_LIMITS: web.AppKey[dict[str, int]] = web.AppKey("body_limits", dict)

#: which limit a route's body has: the control one, ``/generate``'s, or the weights one
BodyKind = Literal["control", "generate", "weights"]


@dataclass(frozen=True)
class Route:
    """One endpoint of a route group: ``method`` (``GET``, ``POST`` or ``*``) and ``path``
    served by the group's method named ``handler``, with the body limit of ``body``."""

    method: str
    path: str
    handler: str
    body: BodyKind = "control"


class RouteGroup(Protocol):
    """An object serving some endpoints: :meth:`routes` names its methods that serve them."""

    def routes(self) -> Sequence[Route]:
        """The endpoints this group serves."""
        ...


def body_limit(request: web.Request) -> int:
    """The largest body ``request``'s endpoint accepts, in bytes."""
    limits = request.app.get(BODY_LIMITS) or {}
    return limits.get(request.path, CONTROL_BODY_LIMIT)


def weights_body_limit(server_args: dict[str, Any]) -> int:
    """The weight-update and adapter endpoints' body limit (``--max-weights-body-mb``)."""
    weights = int(float(server_args.get("max_weights_body_mb") or 0) * (1 << 20))
    return weights or WEIGHTS_BODY_LIMIT


class BadRequest(Exception):
    """A client error: answered with ``status`` and a JSON message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> web.Response:
    """The error body SGLang's native endpoints use."""
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON answer; a bug is a 500, never a dead server. A body
    declared over its endpoint's limit is refused (413) here, before a byte of it is read."""
    try:
        check_declared_size(request, body_limit(request))
        return await handler(request)
    except BodyRejected as exc:
        return error_response(exc.message, exc.status)
    except BadRequest as exc:
        return error_response(str(exc), exc.status)
    except EngineError as exc:
        return error_response(str(exc), exc.status)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.reason or exc.text or "error", exc.status)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("handler %s failed", request.path)
        return error_response(f"internal error: {exc!r}", 500)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read and validate a JSON body; an absent body means ``{}``. The body is bounded by its
    endpoint's limit (:func:`body_limit`, 413 over it), its nesting and its text are checked
    (:func:`miles_engine_client.bodies.loads`, 400): a :class:`BodyRejected` otherwise."""
    raw = await read_body(request, body_limit(request))
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = loads(raw)
        except BodyRejected as exc:
            raise BadRequest(f"malformed JSON body: {exc.message}", exc.status) from None
    if not isinstance(data, dict):
        raise BadRequest("the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise BadRequest("invalid request: " + "; ".join(parts)) from None


async def on_engine(engine: Any, fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(engine)`` on the engine's thread (between two scheduler steps) and await it."""
    return await asyncio.wrap_future(engine.call(fn))


def build_app(
    groups: Iterable[RouteGroup],
    *,
    weights_limit: int,
    on_shutdown: Callable[[web.Application], Awaitable[None]],
) -> web.Application:
    """The aiohttp application serving every route of ``groups``, each with its body limit
    (``weights_limit`` for the weight-update and adapter endpoints). With the run's API key in
    the environment (``MILES_API_KEY``), every route but ``GET /health`` requires it."""
    by_kind = {"generate": GENERATE_BODY_LIMIT, "weights": weights_limit}
    table = [(group, route) for group in groups for route in group.routes()]
    limits = {r.path: by_kind[r.body] for _, r in table if r.body != "control"}
    key = api_key()
    # the key is checked first: a request without it learns nothing, not even a body limit
    middlewares = [api_key_middleware(key)] if key else []
    # client_max_size bounds any read that does not go through parse_body
    app = web.Application(
        middlewares=[*middlewares, errors_middleware],
        client_max_size=max([CONTROL_BODY_LIMIT, *limits.values()]),
    )
    app[BODY_LIMITS] = limits
    for group, route in table:
        handler = getattr(group, route.handler)
        if route.method == "GET":
            app.router.add_get(route.path, handler)
        else:
            app.router.add_route(route.method, route.path, handler)
    app.on_shutdown.append(on_shutdown)
    return app
