"""An engine copies the weights another engine serves (``weights_from_peer``): real server
processes on loopback, the copy read back from both and compared byte for byte; a peer serving
another model, a stream changed on the way, a peer that committed meanwhile, a source that is
not an engine and a peer with another API key are each refused, the puller's weights and
version unchanged."""

from __future__ import annotations

import asyncio
import gc
import json
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp import web
from miles_engine_embedded.launcher import build
from miles_engine_embedded.peer_wire import PeerAnswer
from miles_engine_embedded.plugin import EmbeddedEngineConfig
from miles_transport_common.checksum import part_checksum

from miles_core.hosts import API_KEY_ENV

_LEN = struct.Struct("<Q")
GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def _options() -> EmbeddedEngineConfig:
    return EmbeddedEngineConfig(max_running_requests=2, num_threads=1, startup_timeout_s=120)


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tiny_model_v2: Path) -> Iterator[list[str]]:
    """Two engines of the tiny model (no API key): the source, which then serves other
    weights (``tiny_model_v2``) as version 7, and the puller."""
    launcher = build(_options())
    try:
        urls = [launcher.launch(str(tiny_model), index=i) for i in range(2)]
        r = httpx.post(
            urls[0] + "/update_weights_from_disk",
            json={"model_path": str(tiny_model_v2), "weight_version": "7"},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        yield urls
    finally:
        launcher.shutdown()


def parse_stream(data: bytes) -> tuple[dict[str, Any], list[bytes], dict[str, Any]]:
    """A ``GET /miles/weights`` stream: header, each tensor's bytes, trailer."""
    (n,) = _LEN.unpack_from(data, 0)
    header = json.loads(data[8 : 8 + n])
    at, blobs = 8 + n, []
    for entry in header["tensors"]:
        blobs.append(data[at : at + entry["nbytes"]])
        at += entry["nbytes"]
    (m,) = _LEN.unpack_from(data, at)
    trailer = json.loads(data[at + 8 : at + 8 + m])
    assert at + 8 + m == len(data)
    return header, blobs, trailer


def build_stream(header: dict[str, Any], blobs: list[bytes], trailer: dict[str, Any]) -> bytes:
    """The inverse of :func:`parse_stream`."""
    h, t = json.dumps(header).encode(), json.dumps(trailer).encode()
    return _LEN.pack(len(h)) + h + b"".join(blobs) + _LEN.pack(len(t)) + t


def weights_of(url: str) -> tuple[dict[str, Any], list[bytes], dict[str, Any]]:
    r = httpx.get(url + "/miles/weights", timeout=60)
    assert r.status_code == 200, r.text
    return parse_stream(r.content)


def generate(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


def version_of(url: str) -> str:
    return str(httpx.get(url + "/model_info", timeout=30).json()["weight_version"])


def reset(url: str, model: Path) -> None:
    """Serve ``model`` again as version 1 (other weights than the source's after the first
    test), so a refused copy that changed anything would show."""
    r = httpx.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(model), "weight_version": "1"},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["success"], r.text


def pull(url: str, source: str, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/miles/pull_weights", json={"source": source, **extra}, timeout=120)


class FakePeer:
    """An aiohttp server on loopback answering ``GET /miles/weights`` with ``body()`` (with
    its ``Content-Length``, or in chunks without one when ``chunked``)."""

    def __init__(self, body: Callable[[], bytes], chunked: bool = False) -> None:
        self.body = body
        self.chunked = chunked
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        app = web.Application()

        async def weights(request: web.Request) -> web.StreamResponse:
            if not self.chunked:
                return web.Response(body=self.body(), content_type="application/octet-stream")
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(self.body())
            await response.write_eof()
            return response

        app.router.add_get("/miles/weights", weights)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_an_engine_copies_the_weights_and_version_a_peer_serves(
    engines: list[str], tiny_model: Path
) -> None:
    source, puller = engines
    reset(puller, tiny_model)
    assert generate(source) != generate(puller)  # different weights before the copy
    header, blobs, trailer = weights_of(source)
    assert header["version"] == trailer["version"] == "7"

    r = pull(puller, source)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["success"] and answer["weight_version"] == "7"
    assert answer["bytes"] == sum(len(b) for b in blobs)

    assert version_of(puller) == "7"
    copied_header, copied, _ = weights_of(puller)
    assert [e["name"] for e in copied_header["tensors"]] == [e["name"] for e in header["tensors"]]
    assert copied == blobs  # byte for byte
    assert generate(puller) == generate(source)


def test_a_copy_that_is_not_the_pullers_model_is_refused(
    engines: list[str], make_model: Callable[..., Path], tmp_path: Path, tiny_model: Path
) -> None:
    puller = engines[1]
    reset(puller, tiny_model)
    before, version = weights_of(puller)[1], version_of(puller)
    launcher = build(_options())
    try:
        other = launcher.launch(str(make_model(tmp_path / "qwen3", family="qwen3")), index=0)
        r = pull(puller, other)
    finally:
        launcher.shutdown()
    assert r.status_code == 400, r.text
    assert "other weights than this engine's model" in r.text
    assert weights_of(puller)[1] == before and version_of(puller) == version


@pytest.fixture
def fresh(tiny_model: Path) -> Iterator[str]:
    """An engine of the tiny model that has committed no update: it serves its checkpoint."""
    launcher = build(_options())
    try:
        yield launcher.launch(str(tiny_model), index=0)
    finally:
        launcher.shutdown()


def test_an_engine_serving_its_checkpoint_copies_straight_into_its_weights(
    engines: list[str], fresh: str
) -> None:
    source = engines[0]
    header, blobs, _ = weights_of(source)
    r = pull(fresh, source)
    assert r.status_code == 200, r.text
    assert r.json()["in_place"] and r.json()["weight_version"] == header["version"]
    assert weights_of(fresh)[1] == blobs and generate(fresh) == generate(source)
    # it now serves an update: the next copy goes to new tensors, and one from itself (its
    # scheduler busy with the copy while it also serves the stream) neither hangs nor changes it
    r = pull(fresh, fresh, timeout_s=30)
    assert r.status_code == 200 and not r.json()["in_place"], r.text
    assert weights_of(fresh)[1] == blobs


def with_a_nan(dtype: str, blob: bytes) -> bytes:
    """``blob`` (a tensor's bytes) with its middle element NaN."""
    t = torch.frombuffer(bytearray(blob), dtype=getattr(torch, dtype)).clone()
    t[t.numel() // 2] = float("nan")
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "change, says",
    [("flip_a_byte", "different checksum than sent"), ("a_nan", "holds NaN or infinite")],
)
def test_a_copy_refused_after_its_first_byte_loads_the_checkpoint_again(
    engines: list[str], fresh: str, change: str, says: str
) -> None:
    header, blobs, trailer = weights_of(engines[0])
    before, version, said = weights_of(fresh)[1], version_of(fresh), generate(fresh)
    assert before != blobs
    # every tensor before the last arrives intact, straight into the served weights
    sums = list(trailer["checksums"])
    if change == "flip_a_byte":
        last = bytearray(blobs[-1])
        last[0] ^= 0x01
    else:  # the checksum sent matches: the values are what is refused
        last = bytearray(with_a_nan(header["tensors"][-1]["dtype"], blobs[-1]))
        sums[-1] = part_checksum(torch.frombuffer(last, dtype=torch.uint8))
    body = build_stream(header, [*blobs[:-1], bytes(last)], {**trailer, "checksums": sums})
    fake = FakePeer(lambda: body)
    try:
        r = pull(fresh, fake.url)
    finally:
        fake.close()
    assert r.status_code == 400 and says in r.text, r.text
    assert weights_of(fresh)[1] == before and version_of(fresh) == version
    assert generate(fresh) == said


@pytest.mark.parametrize(
    "change, says",
    [
        ("flip_a_byte", "arrived with a different checksum than sent"),
        ("commit_meanwhile", "committed an update while its weights were read"),
        ("grow_a_tensor", "the peer's is"),
        ("cut_short", "ended"),
        ("huge_table", "more than"),
        ("bad_version", "the peer's weight version"),
        ("bytes_after_the_trailer", "after its trailer"),
        ("no_content_length", "no Content-Length"),
        ("a_nan_sent_as_it_is", "holds NaN or infinite values"),
    ],
)
def test_a_changed_stream_is_refused_and_the_puller_keeps_its_weights(
    engines: list[str], change: str, says: str, tiny_model: Path
) -> None:
    source, puller = engines
    reset(puller, tiny_model)
    header, blobs, trailer = weights_of(source)
    before, version = weights_of(puller)[1], version_of(puller)
    assert before != blobs and version == "1"  # a copy would change both

    def body() -> bytes:
        h, b, t = json.loads(json.dumps(header)), list(blobs), dict(trailer)
        if change == "flip_a_byte":
            first = bytearray(b[0])
            first[len(first) // 2] ^= 0x01
            b[0] = bytes(first)
        elif change == "commit_meanwhile":
            t["commits"] = int(t["commits"]) + 1
        elif change == "grow_a_tensor":
            h["tensors"][0]["shape"][0] += 1
            h["tensors"][0]["nbytes"] *= 2
        elif change == "cut_short":
            return build_stream(h, b, t)[: 8 + 100_000]
        elif change == "huge_table":
            return _LEN.pack(1 << 40) + b"{}"
        elif change == "bad_version":
            h["version"] = t["version"] = "v 1; rm"  # a space: not a version
        elif change == "bytes_after_the_trailer":
            return build_stream(h, b, t) + b"{}"
        elif change == "a_nan_sent_as_it_is":  # its checksum right: the values are refused
            b[0], t["checksums"] = with_a_nan(h["tensors"][0]["dtype"], b[0]), list(t["checksums"])
            t["checksums"][0] = part_checksum(torch.frombuffer(bytearray(b[0]), dtype=torch.uint8))
        return build_stream(h, b, t)

    fake = FakePeer(body, chunked=change == "no_content_length")
    try:
        r = pull(puller, fake.url)
    finally:
        fake.close()
    assert r.status_code == 400, r.text
    assert says in r.text
    assert weights_of(puller)[1] == before and version_of(puller) == version


@pytest.mark.parametrize(
    "source, says",
    [
        ("file:///etc/passwd", "not an http(s) URL"),
        ("http://127.0.0.1:9/some/path", "without a path"),
        ("http://127.0.0.1:9", "copying the weights of"),  # nothing listens there
    ],
)
def test_a_source_that_is_not_an_engine_is_a_400(
    engines: list[str], source: str, says: str
) -> None:
    r = pull(engines[1], source, timeout_s=10)
    assert r.status_code == 400, r.text
    assert says in r.text


def test_a_peer_with_another_api_key_is_refused_naming_the_key(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launchers = [build(_options()), build(_options())]
    try:
        monkeypatch.setenv(API_KEY_ENV, "peer-key-" + "0" * 16)
        peer = launchers[0].launch(str(tiny_model), index=0)
        monkeypatch.setenv(API_KEY_ENV, "puller-key-" + "1" * 16)
        puller = launchers[1].launch(str(tiny_model), index=0)
        headers = {"Authorization": "Bearer puller-key-" + "1" * 16}
        r = httpx.post(
            puller + "/miles/pull_weights", json={"source": peer}, headers=headers, timeout=60
        )
        assert r.status_code == 400, r.text
        assert "401" in r.text and API_KEY_ENV in r.text
        # without the key the peer's weights are not served at all
        assert httpx.get(peer + "/miles/weights", timeout=30).status_code == 401
    finally:
        for launcher in launchers:
            launcher.shutdown()


def test_a_refused_answer_closes_its_connection() -> None:
    fake = FakePeer(lambda: b"{}", chunked=True)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="no Content-Length"):
                PeerAnswer(fake.url, None, time.monotonic() + 30)
            gc.collect()
    finally:
        fake.close()
    leaked = [w for w in seen if issubclass(w.category, ResourceWarning)]
    assert not [w for w in leaked if "socket" in str(w.message)], leaked
