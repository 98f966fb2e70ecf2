"""The session server: OpenAI-compatible chat completions inside sessions, over aiohttp.

URL layout (every path but ``/health`` needs ``Authorization: Bearer <token>`` when the server
has a token)::

    GET    /health
    POST   /sessions                               {"mode": "linear"|"branching"} -> 201
    GET    /sessions                               ids and summaries
    GET    /sessions/{id}                          summary
    DELETE /sessions/{id}
    GET    /sessions/{id}/samples                  training samples (miles_core.data.Sample)
    POST   /sessions/{id}/v1/chat/completions      OpenAI chat completions (stream too)
    POST   /sessions/{id}/v1/messages              Anthropic messages (stream too)
    GET    /sessions/{id}/v1/models

so an OpenAI client uses ``base_url=http://HOST:PORT/sessions/{id}/v1`` and an Anthropic client
``base_url=http://HOST:PORT/sessions/{id}`` (it adds ``/v1/messages``), on the same session.

Run: ``python -m miles_sessions.server --engine-url URL --family qwen3 [--port P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from miles_engine_client.binding import url_host
from pydantic import BaseModel, ConfigDict, ValidationError

from miles_core.hosts import resolve_host
from miles_sessions import anthropic_api
from miles_sessions.appender import Appender
from miles_sessions.auth import authorized, check_bind, server_token
from miles_sessions.openai_api import ChatRequest, chunks, completion
from miles_sessions.options import SessionServerOptions
from miles_sessions.sampling import SAMPLING_KEYS, request_sampling
from miles_sessions.store import Mode, Session, SessionError

log = logging.getLogger("miles_sessions")


class CreateSession(BaseModel):
    """Body of ``POST /sessions`` (may be empty)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Mode | None = None


def _error(status: int, message: str, *, anthropic: bool = False) -> web.Response:
    if anthropic:
        return web.json_response(anthropic_api.error_body(status, message), status=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:10]:
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "invalid request: " + "; ".join(parts)


async def _json_body(
    request: web.Request, limit: int, *, allow_empty: bool = False
) -> dict[str, Any]:
    """The body as a JSON object: at most ``limit`` bytes (refused from ``Content-Length``),
    nesting bounded, no lone surrogates; every refusal a 4xx :class:`SessionError`."""
    from miles_engine_client.bodies import BodyRejected, read_json

    try:
        data = await read_json(request, limit)
    except BodyRejected as exc:
        raise SessionError(exc.status, exc.message) from None
    if data is None:
        if allow_empty:
            return {}
        raise SessionError(400, "the body is empty: a JSON object is required")
    if not isinstance(data, dict):
        raise SessionError(400, f"the body must be a JSON object, not {type(data).__name__}")
    return data


def _text_chars(value: Any) -> int:
    """Characters of every string in ``value`` (iterative: the body's depth is bounded, but
    this needs no recursion either)."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


class SessionServer:
    """Sessions over one engine and one model family.

    Args:
        family: a built :class:`miles_core.contracts.Family`.
        engine: an engine client (``generate(input_ids, sampling_params, ...)``), usually
            :class:`miles_engine_client.EngineClient`.
        options: :class:`SessionServerOptions`.
    """

    def __init__(self, family: Any, engine: Any, options: SessionServerOptions) -> None:
        #: the address it listens on (the node's when ``host`` is not given), and its token
        self.host, self.token = resolve_host(options.host), server_token(options.token)
        check_bind(self.host, self.token)
        self.family = family
        self.engine = engine
        self.options = options
        self.appender = Appender(family, window=options.window, verify_window=options.verify_window)
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- application -----------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(
            client_max_size=self.options.max_body_bytes, middlewares=[self._middleware]
        )
        app.router.add_get("/health", self.health)
        app.router.add_post("/sessions", self.create)
        app.router.add_get("/sessions", self.list_sessions)
        app.router.add_get("/sessions/{sid}", self.get)
        app.router.add_delete("/sessions/{sid}", self.delete)
        app.router.add_get("/sessions/{sid}/samples", self.samples)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self.chat)
        app.router.add_post("/sessions/{sid}/v1/messages", self.messages)
        app.router.add_get("/sessions/{sid}/v1/models", self.models)
        return app

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # Answers on the Messages route are errors as Anthropic's clients read them.
        anthropic = request.path.endswith("/v1/messages")
        if request.path != "/health" and not authorized(
            request.headers.get("Authorization"),
            self.token,
            api_key=request.headers.get("x-api-key"),
        ):
            return _error(
                401,
                "missing or wrong token (Authorization: Bearer <token>, or x-api-key: <token>)",
                anthropic=anthropic,
            )
        try:
            return await handler(request)
        except SessionError as exc:
            return _error(exc.status, exc.message, anthropic=anthropic)
        except ValidationError as exc:
            return _error(400, _validation_message(exc), anthropic=anthropic)
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"the body is larger than {self.options.max_body_bytes} bytes",
                anthropic=anthropic,
            )
        except web.HTTPException as exc:
            if exc.status >= 500:
                raise
            return _error(exc.status, exc.reason, anthropic=anthropic)
        except Exception as exc:  # one request fails, the server does not
            log.exception("unexpected failure on %s %s", request.method, request.path)
            return _error(500, f"internal error: {type(exc).__name__}: {exc}", anthropic=anthropic)

    async def start(self) -> str:
        """Listen; returns the base URL (``http://host:port``)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.options.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{url_host(self.host)}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- sessions --------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        sid = request.match_info["sid"]
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError(404, f"no session {sid!r} (create one with POST /sessions)")
        return session

    def new_session(
        self,
        mode: Mode | None = None,
        *,
        engine: Any = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> Session:
        """Create a session (also usable in-process); ``engine``, when given, generates its
        turns instead of the server's engine (a rollout passes its group's view of one);
        ``sampling``: the session's ``temperature``, ``top_p`` and ``top_k`` where a request
        gives none (a rollout passes the run's)."""
        if len(self.sessions) >= self.options.max_sessions:
            raise SessionError(429, f"too many sessions ({self.options.max_sessions})")
        sid = secrets.token_hex(8)
        session = Session(sid, mode or self.options.default_mode, self.appender)
        session.engine = engine
        session.sampling = {k: v for k, v in (sampling or {}).items() if k in SAMPLING_KEYS}
        self.sessions[sid] = session
        return session

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``."""
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def create(self, request: web.Request) -> web.Response:
        """``POST /sessions``."""
        body = CreateSession.model_validate(
            await _json_body(request, self.options.max_body_bytes, allow_empty=True)
        )
        session = self.new_session(body.mode)
        return web.json_response(
            {**session.describe(), "base_url": f"/sessions/{session.id}/v1"}, status=201
        )

    async def list_sessions(self, request: web.Request) -> web.Response:
        """``GET /sessions``."""
        return web.json_response({"sessions": [s.describe() for s in self.sessions.values()]})

    async def get(self, request: web.Request) -> web.Response:
        """``GET /sessions/{id}``."""
        return web.json_response(self._session(request).describe())

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /sessions/{id}``."""
        session = self._session(request)
        del self.sessions[session.id]
        return web.json_response({"deleted": session.id})

    async def samples(self, request: web.Request) -> web.Response:
        """``GET /sessions/{id}/samples``: one training sample per kept branch."""
        session = self._session(request)
        async with session.lock:
            samples = [s.to_dict() for s in session.samples()]
        return web.json_response({"session_id": session.id, "samples": samples})

    async def models(self, request: web.Request) -> web.Response:
        """``GET .../v1/models``."""
        self._session(request)
        name = self.options.model_name
        return web.json_response(
            {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "miles"}]}
        )

    # --- chat completions ------------------------------------------------------------------

    async def complete(
        self,
        session: Session,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        sampling: dict[str, Any],
    ) -> tuple[Any, int]:
        """Run one turn of ``session`` on ``messages`` (the session's form, whichever API they
        came through): locate, tokenize the appended messages, generate, store. Returns the
        stored turn and the number of prompt tokens."""
        from miles_engine_client import EngineHTTPError

        async with session.lock:
            # Rendering and tokenizing a long message takes a while: off the event loop, so
            # other sessions and /health are answered meanwhile (the lock keeps this session's
            # state to one thread at a time).
            pending = await asyncio.to_thread(session.prepare, messages, tools)
            try:
                engine = session.engine if session.engine is not None else self.engine
                if engine is None:
                    raise SessionError(503, "no engine serves this session")
                result = await engine.generate(
                    pending.input_ids,
                    sampling,
                    return_logprob=True,
                    rid=f"{session.id}-{secrets.token_hex(4)}",
                )
            except EngineHTTPError as exc:
                if 400 <= exc.status < 500:
                    raise SessionError(400, f"the engine refused the turn: {exc.message}") from exc
                raise SessionError(502, f"the engine failed: {exc}") from exc
            except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                # Refused, reset, disconnected mid-turn or timed out: nothing is stored, so
                # the session stays as before the request and the turn can be retried.
                raise SessionError(502, f"the engine is unreachable or failed: {exc!r}") from exc
            if result.finish_reason == "abort":
                raise SessionError(
                    503, "the engine aborted the generation (a weight update?); retry the turn"
                )
            turn = await asyncio.to_thread(
                session.commit,
                pending,
                output_ids=result.output_ids,
                logprobs=result.logprobs,
                finish_reason=result.finish_reason,
                weight_version=result.weight_version,
                routed_experts=result.routed_experts,
                sampling={k: sampling[k] for k in SAMPLING_KEYS if k in sampling},
            )
        return turn, len(pending.input_ids)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /sessions/{id}/v1/chat/completions``."""
        session = self._session(request)
        req = ChatRequest.model_validate(await self._bounded_body(request))
        messages = [m.canonical() for m in req.messages]
        tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None
        drawn = request_sampling(req, session.sampling, self.options, self.family)
        turn, prompt_tokens = await self.complete(session, messages, tools, drawn)
        model = req.model or self.options.model_name
        if not req.stream:
            return web.json_response(
                completion(
                    session,
                    turn,
                    model=model,
                    prompt_tokens=prompt_tokens,
                    logprobs=bool(req.logprobs),
                )
            )
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        resp = await _event_stream(request)
        for c in chunks(
            session, turn, model=model, prompt_tokens=prompt_tokens, usage=include_usage
        ):
            await resp.write(f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _bounded_body(self, request: web.Request) -> dict[str, Any]:
        """The body; a text that cannot fit any context (``messages``, ``system`` and ``tools``
        over ``max_text_chars``) is refused before it is validated or tokenized."""
        data = await _json_body(request, self.options.max_body_bytes)
        chars = _text_chars([data.get("messages"), data.get("system"), data.get("tools")])
        if chars > self.options.max_text_chars:
            raise SessionError(
                413,
                f"messages and tools hold {chars} characters; max_text_chars is "
                f"{self.options.max_text_chars}",
            )
        return data

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /sessions/{id}/v1/messages``: Anthropic's Messages API on the same session
        (see :mod:`miles_sessions.anthropic_api`)."""
        session = self._session(request)
        req = anthropic_api.MessagesRequest.model_validate(await self._bounded_body(request))
        messages, tools = anthropic_api.to_session(req)
        drawn = request_sampling(req, session.sampling, self.options, self.family)
        turn, prompt_tokens = await self.complete(session, messages, tools, drawn)
        model = req.model or self.options.model_name
        if not req.stream:
            return web.json_response(
                anthropic_api.message(session, turn, model=model, prompt_tokens=prompt_tokens)
            )
        resp = await _event_stream(request)
        for event in anthropic_api.events(session, turn, model=model, prompt_tokens=prompt_tokens):
            data = json.dumps(event, ensure_ascii=False)
            await resp.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
        await resp.write_eof()
        return resp


async def _event_stream(request: web.Request) -> web.StreamResponse:
    """A prepared server-sent-events answer."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


def resolve_family(name: str, options: dict[str, Any], *, accept_unverified: bool) -> Any:
    """Build a registered model family by name; refuse one without a valid gate certificate
    unless ``accept_unverified``."""
    from miles_core.components import Kind
    from miles_core.families import family_status
    from miles_core.plugins import load_plugins

    record = load_plugins().registry.get(Kind.MODEL_FAMILY, name)
    opts = record.config.model_validate(options) if record.config is not None else None
    family = record.build(opts)
    status = family_status(family)
    if status["status"] != "verified" and not accept_unverified:
        raise SystemExit(
            f"model family {name!r} is {status['status']}: {status.get('message', '')}\n"
            f"run `miles family verify {name}` or pass --accept-unverified-family"
        )
    return family


def main(argv: list[str] | None = None) -> None:
    """``python -m miles_sessions.server``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-url", required=True)
    p.add_argument("--family", required=True)
    p.add_argument("--family-options", default="{}", help="JSON object")
    p.add_argument("--host", default=None, help="default: this node's address")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token", default=os.environ.get("MILES_SESSIONS_TOKEN"))
    p.add_argument("--mode", choices=("linear", "branching"), default="linear")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--window", choices=("turn", "full"), default="turn")
    p.add_argument("--accept-unverified-family", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from miles_engine_client import EngineClient

    options = SessionServerOptions(
        host=args.host,
        port=args.port,
        token=args.token,
        default_mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        window=args.window,
        family_options=json.loads(args.family_options),
    )
    try:
        check_bind(resolve_host(options.host), server_token(options.token))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    family = resolve_family(
        args.family, options.family_options, accept_unverified=args.accept_unverified_family
    )

    async def serve() -> None:
        engine = EngineClient(args.engine_url, timeout_s=options.engine_timeout_s)
        server = SessionServer(family, engine, options)
        url = await server.start()
        print(f"session server listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()
            await engine.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
