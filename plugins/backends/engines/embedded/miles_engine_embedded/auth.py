"""The run's API key on an engine server.

With the key in the server's environment (:data:`miles_core.hosts.API_KEY_ENV`), every endpoint
but ``GET /health`` asks for ``Authorization: Bearer <key>`` (SGLang's ``--api-key``
convention), whatever address the server binds. Without it, the server may bind only a
loopback address (:func:`miles_engine_client.binding.check_bind`, applied by
:func:`miles_engine_embedded.launcher.bind_listening`).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from miles_core.hosts import API_KEY_ENV, bearer_matches

#: the paths served without the key: the liveness probe of launchers and routers
OPEN_PATHS = frozenset({"/health"})


def _refusal(message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message}},
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="miles"'},
    )


def api_key_middleware(key: str) -> Middleware:
    """An aiohttp middleware answering 401 to every request but ``GET /health`` that does not
    carry ``Authorization: Bearer <key>`` (compared in constant time)."""

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in ("GET", "HEAD") and request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        if not header:
            return _refusal(
                f"{request.path} requires the run's API key: send the header "
                f"`Authorization: Bearer <key>` with the key this server was started with "
                f"({API_KEY_ENV})"
            )
        if not bearer_matches(header, key):
            return _refusal(
                f"{request.path}: wrong API key in the Authorization header: send "
                f"`Authorization: Bearer <key>` with the key this server was started with "
                f"(set {API_KEY_ENV} on the client to the server's)"
            )
        return await handler(request)

    return require_key
