"""Errors raised by the transports; a failed update always raises one of these."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A weight update failed; the receivers stay on their previous weights and version."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait of the transport ran past its timeout (``timeout_s``); the message says which."""


class BucketRejected(TransportError):
    """A bucket failed verification (checksum, sequence or size) on a receiver."""
