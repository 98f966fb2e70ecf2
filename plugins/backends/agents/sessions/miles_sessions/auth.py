"""Who may talk to the session server: loopback by default; anything else needs a token."""

from __future__ import annotations

import hmac
import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token (anyone reaching the port could
    otherwise drive the engine and read every session)."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"refusing to bind the session server to {host!r} without a token: set `token` "
            "(clients then send `Authorization: Bearer <token>`) or bind to 127.0.0.1"
        )


def authorized(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (always true without a token)."""
    if not token:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())
