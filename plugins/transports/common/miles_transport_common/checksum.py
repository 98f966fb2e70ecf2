"""Per-piece and per-bucket checksums, and the weights hash of a named-tensor stream.

Every piece of a bucket (a tensor, or the part of a tensor that bucket carries) has its own
checksum, and a bucket's checksum combines its pieces': a receiver that finds a bucket wrong
names the tensor, and the checksums of the tensors an engine serves can be checked against
the sender's after the update is loaded (see :mod:`.served`).

On CPU the checksums use xxHash (XXH3) over the raw bytes, which runs faster than a memory copy, so
verification costs less than the copy it protects. A CUDA buffer is hashed on its device by a
position-weighted sum (:func:`_device_hash`), so no bytes leave the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xxhash


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (contiguous; a copy only if it was not)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


#: 4-byte words a device hash takes at a time: its temporaries stay a few times this size
#: (two int64 tensors of 32 MiB) however large the buffer.
DEVICE_HASH_WORDS = 1 << 22


def _device_hash(buf: torch.Tensor) -> str:
    # A fast on-device hash: int64 sums of the 4-byte words weighted by an odd multiplicative
    # function of their position, so swapped or flipped bytes change the result. Overflow wraps
    # identically on every device, which keeps the two sides comparable. The words are taken a
    # chunk at a time, and a chunk that does not start 4-byte aligned (a piece of a tensor cut at
    # an odd element, a view into a fused weight) is copied before it is read as words: the
    # result depends on the bytes only.
    n = buf.numel() - buf.numel() % 4
    acc = torch.zeros((), dtype=torch.int64, device=buf.device)
    step = 4 * DEVICE_HASH_WORDS
    for start in range(0, n, step):
        chunk = buf[start : min(start + step, n)]
        if chunk.storage_offset() % 4:
            chunk = chunk.clone()
        words = chunk.view(torch.int32).to(torch.int64)
        first = start // 4
        weights = torch.arange(first, first + words.numel(), device=buf.device, dtype=torch.int64)
        weights.mul_(2654435761).add_(97).bitwise_or_(1)
        acc += words.mul_(weights).sum()
    tail = bytes(buf[n:].cpu().tolist())
    return format(int(acc.item()) & (2**64 - 1), "016x") + tail.hex()


def part_checksum(part: torch.Tensor) -> str:
    """Checksum of one flat uint8 tensor (a piece of a bucket: one tensor, or the part of a
    tensor that bucket carries), as a hex string: XXH3-64 of its bytes on CPU, the device
    hash (prefixed ``d``) on a device. A change of any one byte changes it."""
    if part.device.type != "cpu":
        return "d" + _device_hash(part)
    return xxhash.xxh3_64_hexdigest(part.numpy()) if part.numel() else EMPTY_CHECKSUM


#: :func:`part_checksum` of no bytes.
EMPTY_CHECKSUM = xxhash.xxh3_64_hexdigest(b"")


def combine_checksums(sums: Sequence[str]) -> str:
    """The checksum of a sequence of part checksums, in order (a bucket's, from its pieces')."""
    return xxhash.xxh3_64_hexdigest(";".join(sums).encode())


def part_checksums(parts: Sequence[torch.Tensor]) -> list[str]:
    """:func:`part_checksum` of each of ``parts``."""
    return [part_checksum(p) for p in parts]


def sources_checksum(parts: Sequence[torch.Tensor]) -> str:
    """Checksum of ``parts`` (flat uint8 tensors, one per piece of a bucket), as a hex string:
    the combination of each part's checksum, so the same pieces check the same whether they lie
    in one buffer or many, and a receiver that finds a bucket wrong can say which piece (which
    tensor) is."""
    return combine_checksums(part_checksums(parts))


def bucket_checksum(buf: torch.Tensor, pieces: Sequence[Any] | None = None) -> str:
    """Checksum of the bytes a bucket carries (a flat uint8 buffer), as a hex string.

    With ``pieces`` (objects with ``offset`` and ``nbytes``, a manifest's), only the pieces'
    bytes are hashed, piece by piece: the alignment gaps between them are not part of the
    update, so a transport that writes the pieces straight from their source tensors
    (:func:`sources_checksum`) gets the same checksum."""
    return combine_checksums(piece_checksums(buf, pieces))


def piece_checksums(buf: torch.Tensor, pieces: Sequence[Any] | None = None) -> list[str]:
    """The checksum of each piece of a bucket (``[buf]`` whole without ``pieces``)."""
    if pieces is None:
        return [part_checksum(buf)]
    return part_checksums([buf[p.offset : p.offset + p.nbytes] for p in pieces])


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """Digest of one named tensor: its name, dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    data = _bytes_of(t)
    if data.device.type != "cpu":
        h.update(_device_hash(data).encode())
    else:
        h.update(data.numpy())
    return h.digest()


def combine_digests(digests: dict[str, bytes]) -> str:
    """Order-independent combination of per-tensor digests (sorted by name)."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return h.hexdigest()


def weights_hash(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hash of a named-tensor stream, independent of the order of the stream: equal on the
    sender and the receiver after a successful sync of the same weights."""
    return combine_digests({name: tensor_digest(name, t) for name, t in named_tensors})
