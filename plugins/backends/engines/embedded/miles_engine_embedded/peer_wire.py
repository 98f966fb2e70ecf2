"""The wire of an engine-to-engine weight copy (see :mod:`.peer_routes`): the framing both
ends share, and the puller's reader, which reads the peer's answer straight into the memory
the copy will be served from.

The answer to ``GET /miles/weights`` has a ``Content-Length``: an 8-byte little-endian length
and a JSON header, the tensors' bytes back to back, then a length and a JSON trailer padded
with spaces to a size fixed by the header (:func:`trailer_size`), so the length is known
before the first tensor is hashed.

The reader is a plain HTTP/1.1 client on a blocking socket, run on a worker thread: each
tensor's bytes go from the socket straight into the tensor the copy will be served from
(``recv_into``: no chunk objects, no second copy). Every read is bounded: the
response head by :data:`MAX_HEAD_BYTES`, the header and trailer by :data:`MAX_TABLE_BYTES`,
the tensors by the puller's own model (each byte count is checked before it is read), the
whole by ``Content-Length`` and a deadline.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from typing import Any
from urllib.parse import urlsplit

LEN = struct.Struct("<Q")
#: the largest header or trailer (JSON of the tensor table) a puller reads
MAX_TABLE_BYTES = 64 << 20
#: the largest HTTP response head (status line and headers) a puller reads
MAX_HEAD_BYTES = 64 << 10
#: room a trailer keeps for each checksum (a device hash is the longest, 23 characters)
_CHECKSUM_ROOM = 32


def framed(obj: dict[str, Any], size: int | None = None) -> bytes:
    """``obj`` as JSON behind its 8-byte length, padded with spaces to ``size`` bytes of JSON
    when given (``ValueError`` when it does not fit)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    if size is not None:
        if len(data) > size:
            raise ValueError(f"{len(data)} bytes of JSON do not fit in {size}")
        data += b" " * (size - len(data))
    return LEN.pack(len(data)) + data


def trailer_size(header: dict[str, Any]) -> int:
    """Bytes of JSON the trailer of the stream ``header`` describes is padded to: room for
    the same version, any commit count and one checksum per tensor."""
    widest = {
        "version": header["version"],
        "commits": 2**63,
        "checksums": ["0" * _CHECKSUM_ROOM for _ in header["tensors"]],
    }
    return len(json.dumps(widest, separators=(",", ":"))) + 64


class PeerAnswer:
    """The body of one peer's answer to ``GET /miles/weights``, read from a blocking socket
    before ``deadline`` (``time.monotonic()``). ``TimeoutError`` past it; ``ValueError`` for
    an answer that is not a weight stream (naming what is wrong); ``OSError`` when the
    connection fails."""

    def __init__(self, source: str, key: str | None, deadline: float) -> None:
        parts = urlsplit(source)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.deadline = deadline
        sock = socket.create_connection((host, port), timeout=self._left())
        try:  # a refused answer closes the connection here: the caller never gets the object
            if parts.scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            self.sock = sock
            lines = [
                "GET /miles/weights HTTP/1.1",
                f"Host: {parts.netloc}",
                "Accept: application/octet-stream",
                "Connection: close",
            ]
            if key:
                lines.append(f"Authorization: Bearer {key}")
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            self.pending = b""  # body bytes read along with the head
            self.left = 0  # body bytes not yet read
            self.status, self.headers = self._head()
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        return left

    def _recv(self, n: int) -> bytes:
        self.sock.settimeout(self._left())  # past it, the read raises TimeoutError
        return self.sock.recv(n)

    def _head(self) -> tuple[int, dict[str, str]]:
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > MAX_HEAD_BYTES:
                raise ValueError(f"the peer's response head is over {MAX_HEAD_BYTES} bytes")
            chunk = self._recv(65536)
            if not chunk:
                raise ValueError("the peer closed the connection before answering")
            data += chunk
        head, self.pending = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        fields = status_line.split(" ", 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
            raise ValueError(f"the peer did not answer in HTTP/1.x: {status_line[:80]!r}")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "")
        if not length.isdigit():
            raise ValueError("the peer's answer has no Content-Length")
        self.left = int(length) - len(self.pending)
        if self.left < 0:
            raise ValueError("the peer sent more than its Content-Length")
        return int(fields[1]), headers

    def exact(self, n: int) -> bytes:
        """The next ``n`` bytes of the body."""
        out = bytearray(n)
        self.into(memoryview(out))
        return bytes(out)

    def into(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the body."""
        n = len(view)
        if n > len(self.pending) + self.left:
            short = n - len(self.pending) - self.left
            raise ValueError(f"the peer's stream ended {short} bytes before its table's end")
        take = min(n, len(self.pending))
        view[:take] = self.pending[:take]
        self.pending = self.pending[take:]
        filled = take
        while filled < n:
            self.sock.settimeout(self._left())
            got = self.sock.recv_into(view[filled:], n - filled)
            if not got:
                raise ValueError(f"the peer's stream ended {n - filled} bytes early")
            filled += got
            self.left -= got

    def table(self) -> Any:
        """The next length-prefixed JSON object (a header or trailer)."""
        (n,) = LEN.unpack(self.exact(LEN.size))
        if n > MAX_TABLE_BYTES:
            raise ValueError(f"the peer's table is {n} bytes, more than {MAX_TABLE_BYTES}")
        try:
            return json.loads(self.exact(n))
        except RecursionError as exc:  # nested too deep to be a table
            raise ValueError("the peer's table is not a tensor table") from exc

    def rest(self) -> int:
        """Body bytes not read yet."""
        return len(self.pending) + self.left
