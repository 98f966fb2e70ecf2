"""``miles_engine_client.bodies``: the size, nesting and text bounds of request bodies, through
a real aiohttp server on loopback (raw sockets for what an HTTP client would not send)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from miles_engine_client.bodies import MAX_JSON_DEPTH, BodyRejected, loads, read_json

LIMIT = 1024


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + "1" + close * depth).encode()


# --- loads ---------------------------------------------------------------------------------


def test_loads_accepts_ordinary_json() -> None:
    body = {"input_ids": [[1, 2], [3]], "text": "héllo ✓", "sampling_params": {"top_p": 0.5}}
    assert loads(json.dumps(body).encode()) == body
    assert loads(json.dumps(body, ensure_ascii=False).encode()) == body


def test_loads_depth_limit_is_exact() -> None:
    assert loads(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(BodyRejected) as info:
        loads(nested(MAX_JSON_DEPTH + 1))
    assert info.value.status == 400 and f"{MAX_JSON_DEPTH} levels" in info.value.message
    objects = ('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)).encode()
    with pytest.raises(BodyRejected):
        loads(objects)
    assert loads(nested(3), max_depth=3) == [[[1]]]


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_loads_very_deep_is_400_not_recursion(depth: int) -> None:
    with pytest.raises(BodyRejected) as info:
        loads(nested(depth))
    assert info.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": "\\ud800"}',
        b'{"\\udfff": 1}',
        b'[["ok", {"k": ["\\udc80x"]}]]',
        b'"a\\ud83d"',  # a high surrogate without its low half
    ],
)
def test_loads_refuses_lone_surrogates(raw: bytes) -> None:
    with pytest.raises(BodyRejected) as info:
        loads(raw)
    assert info.value.status == 400 and "surrogate" in info.value.message


def test_loads_keeps_surrogate_pairs() -> None:
    assert loads(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"\xff\xfe{}", b'{"a": "\xc3"}', b"[1,]", b"", '{"a": 1}'.encode("utf-16")],
)
def test_loads_refuses_invalid_json_or_utf8(raw: bytes) -> None:
    with pytest.raises(BodyRejected) as info:
        loads(raw)
    assert info.value.status == 400


# --- read_body / read_json over HTTP -------------------------------------------------------


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    @web.middleware
    async def rejected(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BodyRejected as exc:
            return web.json_response({"error": exc.message}, status=exc.status)

    app = web.Application(middlewares=[rejected])
    app.router.add_post("/echo", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def _echo(request: web.Request) -> web.Response:
    data = await read_json(request, LIMIT)
    return web.json_response({"got": data})


async def _exchange(port: int, raw: bytes, wait_s: float = 3.0) -> bytes:
    def go() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
            sock.sendall(raw)
            try:
                return sock.recv(4096)
            except TimeoutError:
                return b""

    return await asyncio.to_thread(go)


def test_read_json_over_http() -> None:
    async def main() -> None:
        runner, port = await _serve(_echo)
        try:
            body = b'{"a": [1, 2]}'
            head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            answer = await _exchange(port, head.encode() + body)
            assert answer.startswith(b"HTTP/1.1 200") and b'{"got": {"a": [1, 2]}}' in answer
            empty = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            assert b'{"got": null}' in await _exchange(port, empty)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_declared_size_over_the_limit_is_413_from_the_header() -> None:
    async def main() -> None:
        runner, port = await _serve(_echo)
        try:
            head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2147483648\r\n\r\n"
            answer = await _exchange(port, head)  # the body is never sent
            assert answer.startswith(b"HTTP/1.1 413"), answer
            assert b"limited to 1024 bytes" in answer and b"2147483648" in answer
            at_limit = b"[" + b" " * (LIMIT - 2) + b"]"
            head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT}\r\n\r\n"
            assert (await _exchange(port, head.encode() + at_limit)).startswith(b"HTTP/1.1 200")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_chunked_body_is_cut_off_past_the_limit() -> None:
    async def main() -> None:
        runner, port = await _serve(_echo)
        try:
            head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunk = b" " * 600
            part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            # two chunks (1200 bytes) then no end: refused once past the limit, not waited out
            answer = await _exchange(port, head + part + part)
            assert answer.startswith(b"HTTP/1.1 413"), answer
            small = b"[1]"
            ok = head + f"{len(small):x}\r\n".encode() + small + b"\r\n0\r\n\r\n"
            assert (await _exchange(port, ok)).startswith(b"HTTP/1.1 200")
        finally:
            await runner.cleanup()

    asyncio.run(main())
