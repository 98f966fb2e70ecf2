"""Engine-to-engine weight copies (Miles's extension, the ``weights_from_peer`` capability):
``GET /miles/weights`` streams the weights this engine serves, ``POST /miles/pull_weights``
has it take those another engine serves. An engine that joins a running job pulls the current
weights from one that serves them, which goes on generating meanwhile (reading its weights
pauses nothing).

The stream: an 8-byte little-endian length and a JSON header (the weight version, the count
of commits the engine has made, and each tensor's name, dtype, shape and byte count, each
tensor once: a tied head is the embedding), the tensors' bytes back to back, then a length
and a JSON trailer (the version and commit count read again after the last byte, and the
XXH3 checksum of each tensor's bytes as sent). The puller takes only what its own model
serves (the same names, shapes and dtypes, each byte count checked before it is read, so a
peer cannot make it hold more than its own weights), verifies every checksum and refuses a
copy during which the peer committed an update; it then serves the copy under the peer's
version, between two scheduler steps. Nothing in the stream is unpickled.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aiohttp
import torch
from aiohttp import web
from miles_transport_common.checksum import part_checksum
from miles_transport_common.engine_side import check_version
from miles_transport_common.errors import BucketRejected
from pydantic import BaseModel, Field

from miles_core.contracts import each_tensor_once
from miles_core.hosts import API_KEY_ENV, api_key
from miles_engine_embedded.routing import BadRequest, Route, on_engine, parse_body

_LEN = struct.Struct("<Q")
#: the largest header or trailer (JSON of the tensor table) a puller reads
MAX_TABLE_BYTES = 64 << 20
#: bytes written to the response at a time
CHUNK_BYTES = 4 << 20


class PullWeightsRequest(BaseModel):
    """The body of ``POST /miles/pull_weights``."""

    source: str = Field(description="base URL of the engine to copy from (http or https)")
    timeout_s: float = Field(300.0, gt=0, le=3600)


class PeerRoutes:
    """``GET /miles/weights`` and ``POST /miles/pull_weights`` over one engine (see the module
    docstring); ``weights``: the server's :class:`~.weight_routes.WeightRoutes`, whose
    version rules a pulled copy follows."""

    ROUTES: ClassVar[tuple[Route, ...]] = (
        Route("GET", "/miles/weights", "serve_weights"),
        Route("POST", "/miles/pull_weights", "pull_weights"),
    )

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.holder = engine.holder

    def routes(self) -> Sequence[Route]:
        """The endpoints of this group."""
        return self.ROUTES

    def _table(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The served tensors (each once) and the header describing them."""
        holder = self.holder
        pairs = [(n, t.detach()) for n, t in each_tensor_once(holder.params)]
        header = {
            "version": holder.weight_version,
            "commits": holder.commits,
            "tensors": [{"name": n, **_described(t)} for n, t in pairs],
        }
        return pairs, header

    async def serve_weights(self, request: web.Request) -> web.StreamResponse:
        """``GET /miles/weights``: the served weights as one stream (see the module doc)."""
        pairs, header = await on_engine(self.engine, lambda e: self._table())
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        await _write_json(response, header)
        sums = []
        for _, t in pairs:
            data = t.contiguous().reshape(-1).view(torch.uint8).cpu()  # a device's: copied
            sums.append(part_checksum(data))
            view = memoryview(data.numpy())
            for start in range(0, len(view), CHUNK_BYTES):
                await response.write(view[start : start + CHUNK_BYTES])
        holder = self.holder
        await _write_json(
            response,
            {"version": holder.weight_version, "commits": holder.commits, "checksums": sums},
        )
        await response.write_eof()
        return response

    async def pull_weights(self, request: web.Request) -> web.Response:
        """``POST /miles/pull_weights``: copy the weights the engine at ``source`` serves and
        serve them under its version; 400 naming the problem when the copy is refused (the
        served weights and version then unchanged), 504 when the peer did not answer in
        ``timeout_s``."""
        body = await parse_body(request, PullWeightsRequest)
        source = _check_source(body.source)
        t0 = time.perf_counter()
        try:
            named, version, nbytes = await self._fetch(source, body.timeout_s)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            message = f"{source} did not send its weights within {body.timeout_s:g} s: {exc!r}"
            raise BadRequest(message, 504) from exc
        except (aiohttp.ClientError, asyncio.IncompleteReadError, ValueError) as exc:
            raise BadRequest(f"copying the weights of {source}: {exc}") from exc
        fetched = time.perf_counter() - t0

        def adopt(e: Any) -> None:
            e.holder.adopt_named(named)
            e.holder.bump_version(version)

        try:
            await on_engine(self.engine, adopt)
        except ValueError as exc:
            raise BadRequest(f"the weights of {source}: {exc}") from exc
        return web.json_response(
            {
                "success": True,
                "weight_version": self.holder.weight_version,
                "bytes": nbytes,
                "seconds": time.perf_counter() - t0,
                "fetch_seconds": fetched,
            }
        )

    async def _fetch(
        self, source: str, timeout_s: float
    ) -> tuple[list[tuple[str, torch.Tensor]], str, int]:
        """The peer's tensors, checked against this engine's own, its version and the bytes
        read."""
        mine = dict(each_tensor_once(self.holder.params))
        key = api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{source}/miles/weights", headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.content.read(500)).decode(errors="replace")
                    hint = f" (set {API_KEY_ENV} to the peer's key)" if resp.status == 401 else ""
                    raise ValueError(f"GET /miles/weights answered {resp.status}: {text}{hint}")
                stream = _Reader(resp.content)
                header = await stream.json()
                entries = _check_table(header, mine)
                named = []
                total = 0
                for entry in entries:
                    ref = mine[entry["name"]]
                    t = torch.empty(ref.shape, dtype=ref.dtype)  # on the CPU: adopt copies
                    await stream.into(t.reshape(-1).view(torch.uint8))
                    named.append((entry["name"], t))
                    total += entry["nbytes"]
                trailer = await stream.json()
        before = (header["version"], header["commits"])
        if (trailer.get("version"), trailer.get("commits")) != before:
            raise ValueError(
                f"the peer committed an update while its weights were read (version "
                f"{header['version']!r} -> {trailer.get('version')!r}); pull again"
            )
        try:
            check_version(header["version"])
        except BucketRejected as exc:
            raise ValueError(f"the peer's weight version: {exc}") from exc
        sums = trailer.get("checksums")
        if not isinstance(sums, list) or len(sums) != len(named):
            raise ValueError("the trailer does not hold one checksum per tensor")
        for (name, t), expected in zip(named, sums, strict=True):
            if part_checksum(t.reshape(-1).view(torch.uint8)) != expected:
                raise ValueError(f"weight {name!r} arrived with a different checksum than sent")
        return named, str(header["version"]), total


def _described(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's entry in the stream's table, less its name: dtype, shape, bytes."""
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "nbytes": t.numel() * t.element_size(),
    }


def _check_source(source: str) -> str:
    """``source`` as a base URL: http or https with a host, no path beyond ``/``."""
    parts = urlsplit(source)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"source: {source!r} is not an http(s) URL of an engine")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadRequest(f"source: {source!r} must be an engine's base URL, without a path")
    return source.rstrip("/")


def _check_table(header: Any, mine: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The header's tensor entries, when they are exactly the tensors ``mine`` serves."""
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError("the peer's header holds no tensor table")
    if not isinstance(header.get("version"), str) or not isinstance(header.get("commits"), int):
        raise ValueError("the peer's header holds no weight version")
    entries = header["tensors"]
    names = [e.get("name") if isinstance(e, dict) else None for e in entries]
    if names != list(mine):
        missing = sorted(set(mine) - set(map(str, names)))[:3]
        extra = sorted(set(map(str, names)) - set(mine))[:3]
        raise ValueError(
            f"the peer serves other weights than this engine's model (missing {missing}, "
            f"unknown {extra}, or another order)"
        )
    for entry in entries:
        want = _described(mine[entry["name"]])
        got = {k: entry.get(k) for k in want}
        if got != want:
            raise ValueError(f"weight {entry['name']!r}: the peer's is {got}, this engine's {want}")
    return entries


async def _write_json(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    await response.write(_LEN.pack(len(data)) + data)


class _Reader:
    """Exact reads from an aiohttp stream."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self.content = content

    async def json(self) -> Any:
        (n,) = _LEN.unpack(await self.content.readexactly(_LEN.size))
        if n > MAX_TABLE_BYTES:
            raise ValueError(f"the peer's table is {n} bytes, more than {MAX_TABLE_BYTES}")
        try:
            return json.loads(await self.content.readexactly(n))
        except RecursionError as exc:  # nested too deep to be a table
            raise ValueError("the peer's table is not a tensor table") from exc

    async def into(self, out: torch.Tensor) -> None:
        """Fill the flat uint8 tensor ``out`` from the stream."""
        view = memoryview(out.numpy())
        filled = 0
        async for chunk in _chunks(self.content, len(view)):
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)


async def _chunks(content: aiohttp.StreamReader, n: int) -> AsyncIterator[bytes]:
    left = n
    while left:
        chunk = await content.read(min(left, CHUNK_BYTES))
        if not chunk:
            raise ValueError(f"the peer's stream ended {left} bytes early")
        left -= len(chunk)
        yield chunk
