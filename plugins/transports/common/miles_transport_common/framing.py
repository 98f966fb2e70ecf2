"""Control messages of the socket side channels: a 4-byte length, then a JSON object.

Every read is bounded by a :class:`~miles_transport_common.deadline.Deadline`; a closed peer is
reported as such (the usual sign that the other process died).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from typing import Any

from miles_transport_common.deadline import Deadline
from miles_transport_common.errors import TransportError

_LEN = struct.Struct("!I")


def send_msg(sock: socket.socket, msg: dict[str, Any], deadline: Deadline | None = None) -> None:
    """Send one JSON message."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    try:
        sock.settimeout(deadline.remaining() if deadline else None)
        sock.sendall(_LEN.pack(len(body)) + body)
    except TimeoutError as exc:
        raise (deadline.error("sending") if deadline else TransportError(str(exc))) from exc
    except OSError as exc:
        raise TransportError(f"the peer connection broke while sending: {exc}") from exc


#: How long a read with an ``idle`` callback blocks before calling it again.
IDLE_POLL_S = 0.001


def _recv_exact(
    sock: socket.socket, n: int, deadline: Deadline, idle: Callable[[], None] | None = None
) -> bytes:
    chunks = []
    while n:
        wait = max(deadline.remaining(), 1e-3)
        sock.settimeout(min(wait, IDLE_POLL_S) if idle is not None else wait)
        try:
            chunk = sock.recv(min(n, 1 << 20))
        except TimeoutError as exc:
            if idle is not None and not deadline.expired():
                idle()
                continue
            raise deadline.error() from exc
        except OSError as exc:
            raise TransportError(
                f"the peer connection broke while waiting for {deadline.what}: {exc}"
            ) from exc
        if not chunk:
            raise TransportError(
                f"the peer closed the connection while we waited for {deadline.what} "
                "(did the other process exit or die?)"
            )
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(
    sock: socket.socket, deadline: Deadline, idle: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Receive one JSON message before ``deadline``; ``idle`` (if given) is called about every
    millisecond while nothing arrives (e.g. to progress a communication library)."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, idle))
    msg: dict[str, Any] = json.loads(_recv_exact(sock, n, deadline, idle))
    return msg


def expect(msg: dict[str, Any], op: str) -> dict[str, Any]:
    """Check that ``msg`` is an ``op`` message; a ``failed`` message from the peer is raised."""
    if msg.get("op") == "failed":
        raise TransportError(f"the peer reported a failure: {msg.get('reason')}")
    if msg.get("op") != op:
        raise TransportError(f"protocol error: expected {op!r}, got {msg.get('op')!r}")
    return msg


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port`` 0 picks a free one)."""
    srv = socket.create_server((host, port), backlog=64)
    return srv


def accept(srv: socket.socket, deadline: Deadline) -> socket.socket:
    """Accept one connection before ``deadline``."""
    srv.settimeout(max(deadline.remaining(), 1e-3))
    try:
        conn, _ = srv.accept()
    except TimeoutError as exc:
        raise deadline.error() from exc
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """Connect to a sender, retrying until ``deadline`` (the sender may not listen yet)."""
    import time

    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(deadline.remaining(), 1e-3))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError as exc:
            if deadline.expired():
                raise deadline.error(str(exc)) from exc
            time.sleep(0.05)
