"""Who may talk to the session server: loopback by default; anything else needs a token (its
own ``token`` option, else the run's API key, ``MILES_API_KEY``)."""

from __future__ import annotations

import hmac

from miles_core.hosts import API_KEY_ENV, api_key, bearer_matches, is_loopback

__all__ = ["authorized", "check_bind", "is_loopback", "server_token"]


def server_token(token: str | None) -> str | None:
    """The bearer token the server requires: ``token``, else the run's API key, else none."""
    return token or api_key()


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token (anyone reaching the port could
    otherwise drive the engine and read every session)."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"refusing to bind the session server to {host!r} without a token: set `token` or "
            f"the run's API key {API_KEY_ENV} (clients then send `Authorization: Bearer "
            "<token>`), or bind to 127.0.0.1"
        )


def authorized(header: str | None, token: str | None, *, api_key: str | None = None) -> bool:
    """Whether a request carries ``token``: in its ``Authorization: Bearer`` header, or in
    ``api_key`` (its ``x-api-key`` header, where Anthropic's clients send their key). Always
    true without a token."""
    if not token:
        return True
    if api_key is not None and hmac.compare_digest(api_key.encode(), token.encode()):
        return True
    return bearer_matches(header, token)
