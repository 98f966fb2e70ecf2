"""Where a server of the run listens, and whether it may: the rule every engine server and
router of Miles applies before it binds.

A server binds its node's address by default (:func:`miles_core.hosts.resolve_host`). One that
would listen beyond loopback without the run's API key is refused (:func:`check_bind`): anyone
reaching its port could otherwise generate, replace the weights or route traffic.
"""

from __future__ import annotations

from miles_core.hosts import API_KEY_ENV, api_key, is_loopback, node_address


class BindRefused(ValueError):
    """A server was asked to listen beyond loopback without the run's API key."""


def check_bind(host: str, server: str) -> None:
    """Raise :class:`BindRefused` (naming ``server`` and ``MILES_API_KEY``) when ``host`` is
    not a loopback address and no API key is set."""
    if not is_loopback(host) and api_key() is None:
        raise BindRefused(
            f"refusing to start {server} on {host!r} without an API key: a server reachable "
            f"beyond loopback requires one. Set {API_KEY_ENV} (every client of the run then "
            "sends `Authorization: Bearer <key>`), or bind a loopback address such as 127.0.0.1"
        )


def url_host(host: str) -> str:
    """``host`` as a URL to a server bound there spells it: the node's address for a wildcard
    bind (``0.0.0.0``, ``::``), brackets around an IPv6 address."""
    if host in ("", "0.0.0.0", "::"):
        host = node_address()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
