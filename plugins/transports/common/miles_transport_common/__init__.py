"""Shared machinery of Miles's weight-sync transports.

Bucketing of a named-tensor stream into bounded flat byte buffers (:mod:`.bucketing`), per-bucket
checksums and the weights hash (:mod:`.checksum`), receiver-side assembly and all-or-nothing
commit (:mod:`.staging`), deadlines (:mod:`.deadline`), the control-message framing of the
socket side channels (:mod:`.framing`) and the options every transport shares (:mod:`.options`).
"""

from __future__ import annotations

from miles_transport_common.errors import BucketRejected, TransportError, TransportTimeout
from miles_transport_common.options import TransportOptions

__all__ = ["BucketRejected", "TransportError", "TransportOptions", "TransportTimeout"]
