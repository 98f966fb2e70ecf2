"""Engine-to-engine weight copies (Miles's extension, the ``weights_from_peer`` capability):
``GET /miles/weights`` streams the weights this engine serves, ``POST /miles/pull_weights``
has it take those another engine serves. An engine that joins a running job pulls the current
weights from one that serves them, which goes on generating meanwhile (reading its weights
pauses nothing).

The stream (:mod:`.peer_wire`): a JSON header (the weight version, the count of commits the
engine has made, and each tensor's name, dtype, shape and byte count, each tensor once: a tied
head is the embedding), the tensors' bytes back to back, then a JSON trailer (the version and
commit count read again after the last byte, and the XXH3 checksum of each tensor's bytes as
sent). The puller takes only what its own model serves (the same names, shapes and dtypes,
each byte count checked before it is read, so a peer cannot make it hold more than its own
weights), reads each tensor's bytes from the socket straight into its place, verifies every
checksum and refuses a copy during which the peer committed an update; it then serves the copy
under the peer's version. Nothing in the stream is unpickled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import torch
from aiohttp import web
from miles_transport_common.checksum import part_checksum
from miles_transport_common.engine_side import check_version
from miles_transport_common.errors import BucketRejected
from pydantic import BaseModel, Field

from miles_core.contracts import each_tensor_once
from miles_core.hosts import API_KEY_ENV, api_key
from miles_engine_embedded.peer_wire import (
    LEN,
    PeerAnswer,
    framed,
    trailer_size,
)
from miles_engine_embedded.routing import BadRequest, Route, on_engine, parse_body

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
        version, commits = holder.weight_version, holder.commits  # before any tensor
        pairs = [(n, t.detach()) for n, t in each_tensor_once(holder.params)]
        header = {
            "version": version,
            "commits": commits,
            "tensors": [{"name": n, **_described(t)} for n, t in pairs],
        }
        return pairs, header

    async def serve_weights(self, request: web.Request) -> web.StreamResponse:
        """``GET /miles/weights``: the served weights as one stream (see the module doc)."""
        # Read here, not on the scheduler thread (which may be busy pulling into this very
        # engine): a commit meanwhile changes the commit count the trailer reads again.
        pairs, header = self._table()
        head = framed(header)
        room = trailer_size(header)
        body = sum(e["nbytes"] for e in header["tensors"])
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(head) + body + LEN.size + room
        await response.prepare(request)
        await response.write(head)
        sums = []
        for _, t in pairs:
            data = t.contiguous().reshape(-1).view(torch.uint8).cpu()  # a device's: copied
            sums.append(part_checksum(data))
            view = memoryview(data.numpy())
            for start in range(0, len(view), CHUNK_BYTES):
                await response.write(view[start : start + CHUNK_BYTES])
        holder = self.holder
        trailer = {"version": holder.weight_version, "commits": holder.commits, "checksums": sums}
        try:
            await response.write(framed(trailer, room))
        except ValueError:  # a new version too long for the room: the puller refuses the copy
            await response.write(framed({"version": None, "commits": -1}, room))
        await response.write_eof()
        return response

    async def pull_weights(self, request: web.Request) -> web.Response:
        """``POST /miles/pull_weights``: copy the weights the engine at ``source`` serves and
        serve them under its version; 400 naming the problem when the copy is refused (the
        served weights and version then unchanged), 504 when the peer did not answer in
        ``timeout_s``.

        An engine that still serves the checkpoint it loaded (no update committed since: an
        engine that has just joined) reads the copy straight into its weights, between two
        scheduler steps, and loads its checkpoint again if the copy is refused after its
        first byte. Any other reads it into new tensors on a worker thread while it goes on
        generating, and serves from them once every check has passed."""
        body = await parse_body(request, PullWeightsRequest)
        pull = _Pull(
            _check_source(body.source),
            dict(each_tensor_once(self.holder.params)),
            time.monotonic() + body.timeout_s,
            in_place=_serves_its_checkpoint(self.holder),
        )
        t0 = time.perf_counter()
        try:
            if pull.in_place:
                await on_engine(self.engine, pull.into_engine)
            else:
                await asyncio.to_thread(pull.fetch)
                await on_engine(self.engine, pull.adopt)
        except TimeoutError as exc:
            message = f"{pull.source} did not send its weights within {body.timeout_s:g} s: {exc}"
            raise BadRequest(message, 504) from exc
        except (OSError, ValueError) as exc:
            raise BadRequest(f"copying the weights of {pull.source}: {exc}") from exc
        return web.json_response(
            {
                "success": True,
                "weight_version": self.holder.weight_version,
                "bytes": pull.nbytes,
                "seconds": time.perf_counter() - t0,
                "fetch_seconds": pull.fetch_s,
                "in_place": pull.in_place,
            }
        )


def _serves_its_checkpoint(holder: Any) -> bool:
    """Whether ``holder`` serves the checkpoint it loaded, from its own CPU tensors (no update
    committed since), so a refused copy read into them can be undone by loading it again."""
    if holder.commits or holder.adopted or not Path(holder.model_path).is_dir():
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() for t in holder.params.values())


class _Pull:
    """One copy of the weights the engine at ``source`` serves. ``mine``: this engine's (each
    once), read into when ``in_place``, else the model of the new tensors."""

    def __init__(
        self, source: str, mine: dict[str, torch.Tensor], deadline: float, *, in_place: bool
    ) -> None:
        self.source = source
        self.mine = mine
        self.deadline = deadline
        self.in_place = in_place
        self.named: list[tuple[str, torch.Tensor]] = []
        self.version = ""
        self.nbytes = 0
        self.fetch_s = 0.0
        self.wrote = False  # a byte was read into the served tensors

    def into_engine(self, e: Any) -> None:
        """On the scheduler thread: read the copy into the served tensors and commit it;
        load the checkpoint again when it is refused after its first byte was written. An
        update committed since the request came: the copy goes to new tensors instead."""
        self.mine = dict(each_tensor_once(e.holder.params))  # as served now
        self.in_place = _serves_its_checkpoint(e.holder)
        if not self.in_place:
            self.fetch()
            self.adopt(e)
            return
        try:
            self.fetch()
            e.holder.commit_written([name for name, _ in self.named])
            e.holder.bump_version(self.version)
        except BaseException:
            if self.wrote:
                e.holder.load_from_disk(e.holder.model_path)
            raise

    def adopt(self, e: Any) -> None:
        """On the scheduler thread: serve from the tensors read."""
        e.holder.adopt_named(self.named)
        e.holder.bump_version(self.version)

    def fetch(self) -> None:
        """Read and check the peer's tensors (blocking reads; see the module doc)."""
        t0 = time.perf_counter()
        answer = PeerAnswer(self.source, api_key(), self.deadline)
        try:
            if answer.status != 200:
                text = answer.exact(min(500, answer.rest())).decode(errors="replace")
                hint = f" (set {API_KEY_ENV} to the peer's key)" if answer.status == 401 else ""
                raise ValueError(f"GET /miles/weights answered {answer.status}: {text}{hint}")
            header = answer.table()
            entries = _check_table(header, self.mine)
            try:
                check_version(header["version"])
            except BucketRejected as exc:
                raise ValueError(f"the peer's weight version: {exc}") from exc
            for entry in entries:
                ref = self.mine[entry["name"]]
                t = ref.detach() if self.in_place else torch.empty(ref.shape, dtype=ref.dtype)
                self.wrote = self.wrote or self.in_place
                answer.into(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                self.named.append((entry["name"], t))
            trailer = answer.table()
            if answer.rest():
                raise ValueError(f"the peer sent {answer.rest()} bytes after its trailer")
        finally:
            answer.close()
        _check_trailer(header, trailer, self.named)
        self.version = str(header["version"])
        self.nbytes = sum(e["nbytes"] for e in entries)
        self.fetch_s = time.perf_counter() - t0


def _check_trailer(
    header: dict[str, Any], trailer: Any, named: list[tuple[str, torch.Tensor]]
) -> None:
    """Refuse a copy during which the peer committed, or whose bytes differ from the sent."""
    if not isinstance(trailer, dict):
        raise ValueError("the peer's trailer is not a table")
    before = (header["version"], header["commits"])
    if (trailer.get("version"), trailer.get("commits")) != before:
        raise ValueError(
            f"the peer committed an update while its weights were read (version "
            f"{header['version']!r} -> {trailer.get('version')!r}); pull again"
        )
    sums = trailer.get("checksums")
    if not isinstance(sums, list) or len(sums) != len(named):
        raise ValueError("the trailer does not hold one checksum per tensor")
    for (name, t), expected in zip(named, sums, strict=True):
        if part_checksum(t.reshape(-1).view(torch.uint8)) != expected:
            raise ValueError(f"weight {name!r} arrived with a different checksum than sent")


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
