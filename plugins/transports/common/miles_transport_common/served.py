"""The check that an engine serves, after an update, exactly the tensors the sender sent.

Every piece of a bucket carries its checksum (:attr:`Manifest.sums`, computed by the sender as it
packs). A receiver verifies each piece on arrival, so a byte changed on the way names its tensor.
That proves what *arrived*; what the engine *serves* after loading it is checked again at the
commit (:func:`check_served`): the engine reads each tensor of the update back from its model by
name and

* a tensor the model serves from the very memory that was hashed on arrival (an adopting
  commit: same address, dtype and shape as the verified staged view) is the verified bytes;
* any other (a copying load, a tensor the target copied, reassembled or converted) is hashed
  again, piece by piece, and compared with the sender's checksums;
* a tensor the model does not have, or with another size, fails.

A mismatch refuses the commit (the version is not bumped, the receiver is marked inconsistent)
with an error naming the tensor; the commit's answer otherwise carries the checksum of what the
engine now serves for this update (:meth:`TensorSums.checksum`), which the sender compares with
its own (:func:`check_reported`), so a failure names the engine as well.

The checksums are XXH3-64 of the bytes on CPU and a position-weighted int64 sum of the 4-byte
words on a device (:mod:`.checksum`): both change when any one element changes, XXH3 because
every input bit affects every output bit, the device sum because a changed 4-byte word (an
element of up to 4 bytes lies in one) changes its term by its non-zero difference times an odd
weight, which is never 0 modulo 2**64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_transport_common.bucketing import Manifest, Piece
from miles_transport_common.checksum import (
    _bytes_of,
    _device_hash,
    combine_checksums,
    part_checksum,
)
from miles_transport_common.errors import BucketRejected, TransportError

#: ``read(names)``: the tensors the engine serves under these names (a name it does not serve
#: is left out).
ReadServed = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


class ServedMismatch(BucketRejected):
    """After loading an update, the engine serves a tensor unlike the one the sender sent."""


@dataclass
class TensorSums:
    """The sender's checksum of every tensor of an update, as the pieces that carried it:
    name -> [(byte offset in the tensor, bytes, checksum)]."""

    spans: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)

    def add(self, pieces: Sequence[Piece], sums: Sequence[str]) -> None:
        """Record a bucket's pieces with their checksums (none: a bucket without them)."""
        for p, s in zip(pieces, sums, strict=False):
            if p.start == 0:
                self.spans[p.name] = []
            self.spans.setdefault(p.name, []).append((p.start, p.nbytes, s))

    def add_manifest(self, manifest: Manifest) -> None:
        """Record the pieces of a manifest."""
        self.add(manifest.pieces, manifest.sums)

    def of(self, name: str) -> str:
        """The checksum of one tensor (its pieces' combined)."""
        return combine_checksums([s for _, _, s in self.spans[name]])

    def checksum(self) -> str:
        """The checksum of the whole update, independent of the order of the tensors."""
        return combine_checksums([f"{n}={self.of(n)}" for n in sorted(self.spans)])


def _rehash(data: torch.Tensor, expected: str) -> str:
    # Hashed the way the sender hashed it: a device sum ("d" and 16 hex digits, then the tail
    # bytes; an XXH3 checksum is exactly 16 hex digits) wherever the tensor now lies, XXH3 of
    # the bytes otherwise (brought to the CPU first if it lies on a device).
    if len(expected) > 16 and expected.startswith("d"):
        return "d" + _device_hash(data)
    return part_checksum(data.cpu() if data.device.type != "cpu" else data)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
    )


def _mismatch(name: str, t: torch.Tensor | None, spans: list[tuple[int, int, str]]) -> str | None:
    """Why the served tensor ``t`` differs from the sender's, or None when it does not."""
    if t is None:
        return f"{name!r} is not served by this engine's model"
    data = _bytes_of(t)
    total = max((start + n for start, n, _ in spans), default=0)
    if data.numel() != total:
        return f"{name!r} is served with {data.numel()} bytes, the sender sent {total}"
    for start, n, want in spans:
        got = _rehash(data[start : start + n], want)
        if got != want:
            where = "" if (start, n) == (0, total) else f" (bytes {start}..{start + n})"
            return f"{name!r}{where}: served checksum {got}, the sender's {want}"
    return None


def check_served(
    sums: TensorSums,
    read: ReadServed,
    verified: Mapping[str, torch.Tensor],
    version: int | str | None,
) -> str:
    """Check that the engine serves every tensor of ``sums`` (see the module docstring);
    ``verified``: the staged tensors whose own memory was hashed on arrival. Returns the
    checksum of what is served for the update; raises :class:`ServedMismatch` naming the
    tensors that differ."""
    names = sorted(sums.spans)
    served = read(names)
    bad = []
    with torch.no_grad():
        for name in names:
            t = served.get(name)
            v = verified.get(name)
            if t is not None and v is not None and _same_memory(t, v):
                continue
            why = _mismatch(name, t, sums.spans[name])
            if why is not None:
                bad.append(why)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ServedMismatch(
            f"after loading update {version}, {len(bad)} tensor(s) served differ from what the "
            f"sender sent: {'; '.join(bad[:3])}{more}; the commit is refused"
        )
    return sums.checksum()


def check_reported(engine: str, answer: Mapping[str, Any], sums: TensorSums, version: int) -> None:
    """The sender's side: an engine that checks what it serves answers the commit with its
    ``weights_checksum``; raise :class:`TransportError` naming ``engine`` unless it equals the
    sender's. An engine that answers none (SGLang) is not checked here."""
    got = answer.get("weights_checksum")
    if got is not None and got != sums.checksum():
        raise TransportError(
            f"engine {engine} serves update {version} with weights checksum {got}, the sender's "
            f"is {sums.checksum()}: the weights it serves are not the ones sent"
        )


def first_difference(
    engine: str, pieces: Iterable[Piece], sent: Sequence[str], got: Sequence[str]
) -> str | None:
    """The tensor whose checksum ``got`` (an engine's answer) differs from ``sent``, as a
    message naming ``engine``; None when they agree."""
    for p, a, b in zip(pieces, sent, got, strict=False):
        if a != b:
            return (
                f"engine {engine} received tensor {p.name!r} (bytes {p.start}..{p.start + p.nbytes}"
                f") with a different checksum ({b}; the sender's {a})"
            )
    return None
