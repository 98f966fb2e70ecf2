"""The address of the node a process runs on, whether an address is loopback, and the API key
every Miles server and client of a run shares.

A placement that puts a process on a node of a cluster sets :data:`NODE_ADDRESS_ENV` in it
(the Ray placement: the node's IP as Ray knows it); every server that process starts binds
that address and advertises it, and every rendezvous it hosts listens there. Without one, a
process is on this machine alone: ``127.0.0.1``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

#: the environment variable that names this process's node address
NODE_ADDRESS_ENV = "MILES_NODE_ADDRESS"

#: the address of a process that no placement put on a node
LOCAL = "127.0.0.1"

#: the environment variable that holds the run's API key: a server that listens beyond
#: loopback requires it (``Authorization: Bearer <key>``, SGLang's ``--api-key`` convention),
#: and every client of the run sends it. Kept out of config files, run records and logs.
API_KEY_ENV = "MILES_API_KEY"


def node_address() -> str:
    """This process's node address (:data:`NODE_ADDRESS_ENV`, else :data:`LOCAL`)."""
    return os.environ.get(NODE_ADDRESS_ENV) or LOCAL


def resolve_host(host: str | None) -> str:
    """``host`` as given, or this node's address when it is ``None`` or empty."""
    return host or node_address()


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the addresses of 127.0.0.0/8 and ::1; False for any other
    name or address (a name is not resolved: only loopback literals count)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key() -> str | None:
    """The run's API key (:data:`API_KEY_ENV`), ``None`` when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <key>`` (the scheme in any
    case, the key compared in constant time): how every Miles server checks the run's key."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def auth_headers() -> dict[str, str]:
    """The headers a client of the run's servers sends: ``Authorization: Bearer <key>`` with
    an API key, none without."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def forwarded_env() -> dict[str, str]:
    """What a process started for the run on another node takes from this one's environment:
    the run's API key, when there is one."""
    key = api_key()
    return {API_KEY_ENV: key} if key else {}
