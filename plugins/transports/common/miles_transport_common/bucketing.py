"""Packing a named-tensor stream into buckets of bounded size.

A bucket is a flat uint8 buffer of at most ``bucket_bytes`` plus a manifest of *pieces*
(name, dtype, shape, offset in the bucket, bytes, offset in the tensor). Each tensor starts at a
64-byte aligned offset, so a tensor that fits whole in a bucket can be viewed in place on the
receiver with its dtype and shape. A tensor larger than the room left is split at an element
boundary and continues at offset 0 of the next bucket; the receiver reassembles it. So any
tensor, however large, travels through buffers of a fixed size.

A tensor that fits in an empty bucket is never split: when it does not fit in the room left,
the bucket is closed and the tensor starts the next one, so on the receiver every such tensor is
a view of one bucket and nothing needs reassembling (a copy saved per bucket boundary).

The packer owns ``num_buffers`` buffers and fills them in turn; the caller is told, before a
buffer is refilled, which slot is about to be reused (``before_fill``) so it can wait for the
transfer that still reads it. The sender's extra memory is therefore ``num_buffers`` buckets,
whatever the model size; :attr:`BucketPacker.allocated_bytes` counts it. With
``num_buffers=None`` every bucket of an update gets its own slot (slot = sequence number), kept
from one update to the next: a transport whose receivers serve straight from the sender's
buffers uses two such packers in turn.

Checksums can be computed on a worker thread (``hasher``), so hashing bucket *k* overlaps
packing bucket *k + 1*; :meth:`PackedBucket.ready` waits for the checksum. With
``hash_inline`` (CPU buffers) each piece is instead copied in cache-sized chunks and every chunk
is hashed right after its copy, while it is still in the core's cache: the checksum then costs
no second pass over memory, and the other core stays free for the receiver's verification.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from miles_transport_common.checksum import (
    EMPTY_CHECKSUM,
    combine_checksums,
    part_checksum,
    part_checksums,
    piece_checksums,
)

#: Alignment of the start of each tensor inside a bucket, in bytes.
ALIGN = 64
#: Bytes copied then hashed at a time by an inline-hashing packer (fits a core's L2 cache).
INLINE_CHUNK = 1 << 19


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; an unknown name is a clear error."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a bucket manifest")
    return dtype


@dataclass(frozen=True)
class Piece:
    """One contiguous run of a tensor's bytes inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket
    nbytes: int  # bytes of this piece
    start: int  # byte offset of this piece inside the tensor
    total: int  # the tensor's total bytes

    @property
    def whole(self) -> bool:
        """The piece is the entire tensor."""
        return self.start == 0 and self.nbytes == self.total


@dataclass
class Manifest:
    """What a bucket carries: its sequence number in the update, size, checksum and pieces,
    and the checksum of each piece (``sums``, in the order of ``pieces``; the bucket's checksum
    combines them)."""

    seq: int
    nbytes: int
    checksum: str
    pieces: list[Piece] = field(default_factory=list)
    sums: list[str] = field(default_factory=list)

    def set_sums(self, sums: list[str]) -> None:
        """Record the pieces' checksums and the bucket's checksum they make."""
        self.sums = sums
        self.checksum = combine_checksums(sums)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (pieces as lists, to keep control messages small)."""
        return {
            "seq": self.seq,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "sums": self.sums,
            "pieces": [
                [p.name, p.dtype, list(p.shape), p.offset, p.nbytes, p.start, p.total]
                for p in self.pieces
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """Inverse of :meth:`to_json`. A manifest that does not describe its own bytes (a
        negative or non-integer field, a piece outside the bucket or its tensor, a tensor
        size that does not match its shape and dtype) is a ``ValueError`` naming the field."""
        if not isinstance(data, dict) or not isinstance(data.get("pieces"), list):
            raise ValueError("a bucket manifest must be a dict with a list of pieces")
        seq, nbytes = _count(data.get("seq"), "seq"), _count(data.get("nbytes"), "nbytes")
        pieces = []
        for raw in data["pieces"]:
            if not isinstance(raw, (list, tuple)) or len(raw) != 7:
                raise ValueError(f"manifest piece {raw!r}: expected 7 fields")
            n, d, s, o, b, st, t = raw
            if not isinstance(n, str) or not isinstance(d, str) or not isinstance(s, list):
                raise ValueError(f"manifest piece {raw!r}: name, dtype and shape are malformed")
            shape = tuple(_count(x, f"shape of {n!r}") for x in s)
            p = Piece(n, d, shape, *(_count(x, f"piece {n!r}") for x in (o, b, st, t)))
            size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype_from_name(d)).itemsize
            if p.offset + p.nbytes > nbytes or p.start + p.nbytes > p.total or p.total != size:
                raise ValueError(
                    f"manifest piece {n!r}: bytes [{p.offset}, {p.offset + p.nbytes}) of a "
                    f"{nbytes}-byte bucket, [{p.start}, {p.start + p.nbytes}) of a "
                    f"{p.total}-byte tensor ({size} bytes for {d} {shape}): out of range"
                )
            pieces.append(p)
        sums = data.get("sums", [])
        if not isinstance(sums, list) or not all(isinstance(x, str) and len(x) <= 64 for x in sums):
            raise ValueError("manifest sums must be a list of checksum strings")
        if sums and len(sums) != len(pieces):
            raise ValueError(f"manifest has {len(sums)} sums for {len(pieces)} pieces")
        return cls(seq, nbytes, str(data.get("checksum")), pieces, list(sums))


def tight_pieces(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[Piece]:
    """The layout SGLang's ``flattened_bucket`` gives a bucket of these tensors: their bytes
    back to back, in order."""
    pieces = []
    offset = 0
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype_from_name(str(dt).removeprefix("torch."))
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        pieces.append(Piece(name, dtype_name(dtype), tuple(shape), offset, nbytes, 0, nbytes))
        offset += nbytes
    return pieces


def _count(value: Any, field: str) -> int:
    """``value`` when it is a non-negative int, else a ``ValueError`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"manifest {field} must be a non-negative int, got {value!r}")
    return value


@dataclass
class PackedBucket:
    """A filled bucket: the slot of the packer buffer it lives in, its bytes and manifest."""

    slot: int
    data: torch.Tensor  # uint8 view of the slot buffer, ``manifest.nbytes`` long
    manifest: Manifest
    _checksum: Future[list[str]] | None = None
    #: zero-copy layout: the source bytes of each piece (``data`` is then empty)
    sources: list[torch.Tensor] = field(default_factory=list)

    def ready(self) -> PackedBucket:
        """Wait for the checksums (computed on the packer's hasher thread) and fill them in."""
        if self._checksum is not None:
            self.manifest.set_sums(self._checksum.result())
            self._checksum = None
        return self


Allocator = Callable[[int, int], torch.Tensor]


def _default_allocator(device: str) -> Allocator:
    def allocate(slot: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    return allocate


class BucketPacker:
    """Packs named tensors into at most ``num_buffers`` reusable buffers of ``bucket_bytes``.

    Args:
        bucket_bytes: the bound of one bucket.
        num_buffers: buffers used in turn (2 lets one be filled while the other is in flight);
            ``None``: one buffer per bucket of the update, never reused within it.
        allocate: ``allocate(slot, nbytes)`` returns a flat uint8 tensor (shared memory,
            registered memory, a device buffer...); default: ``torch.empty`` on ``device``.
        device: where the default allocator puts the buffers.
        hasher: an executor that computes bucket checksums off the packing thread (None:
            computed inline).
        zero_copy: lay the buckets out without copying anything: each yielded bucket carries
            its manifest and the source bytes of its pieces (``sources``), for a transport that
            moves them straight from the source tensors to their offsets on the receiver.
        hash_inline: hash each chunk of a CPU bucket right after copying it (see the module
            docstring); ``hasher`` is then not used for CPU buffers.
        align: alignment of each tensor's start inside a bucket (1: tensors back to back, the
            layout SGLang's ``flattened_bucket`` format computes from names, dtypes and shapes).
        split: split a tensor larger than a bucket across buckets (default). ``False``: such a
            tensor travels whole, alone in a bucket of its own size (for a receiver that loads
            whole tensors only, as SGLang's weight-update endpoints do); the bound of a bucket
            is then ``max(bucket_bytes, largest tensor)``.
        alone_in_place: with ``split=False`` and ``hash_inline``, a CPU tensor larger than a
            bucket travels from its own memory: its bucket's ``data`` is a view of the source
            tensor, hashed, never copied (a transport whose buffers need no special memory,
            shared or registered, and whose caller leaves the tensors unchanged while it
            sends). The packer's buffers then stay one bucket long.
    """

    def __init__(
        self,
        bucket_bytes: int,
        *,
        num_buffers: int | None = 2,
        allocate: Allocator | None = None,
        device: str = "cpu",
        hasher: Executor | None = None,
        zero_copy: bool = False,
        hash_inline: bool = False,
        align: int = ALIGN,
        split: bool = True,
        alone_in_place: bool = False,
    ) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
        if align < 1:
            raise ValueError(f"align must be at least 1, got {align}")
        self.align = align
        self.split = split
        self.alone_in_place = alone_in_place
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self._allocate = allocate or _default_allocator(device)
        self.hasher = hasher
        self.zero_copy = zero_copy
        self.hash_inline = hash_inline and not zero_copy
        self.buffers: list[torch.Tensor] = []
        #: bytes of packing buffers allocated so far (the sender's extra memory).
        self.allocated_bytes = 0

    def buffer(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The buffer of ``slot`` (at least ``nbytes``, default a bucket), allocated on first
        use and grown (replaced) when a larger one is needed."""
        need = max(self.bucket_bytes, nbytes or 0)
        while len(self.buffers) <= slot:
            buf = self._allocate(len(self.buffers), self.bucket_bytes)
            self.allocated_bytes += buf.numel() * buf.element_size()
            self.buffers.append(buf)
        if self.buffers[slot].numel() < need:
            old = self.buffers[slot]
            self.allocated_bytes -= old.numel() * old.element_size()
            self.buffers[slot] = buf = self._allocate(slot, need)
            self.allocated_bytes += buf.numel() * buf.element_size()
        return self.buffers[slot]

    def pack(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        before_fill: Callable[[int], None] | None = None,
        on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    ) -> Iterator[PackedBucket]:
        """Yield the filled buckets of the stream, in order.

        ``before_fill(slot)`` is called before a slot's buffer is written again (wait there for
        the transfer still reading it); ``on_tensor(name, tensor)`` sees each source tensor once
        (used to hash the stream). A yielded bucket stays valid until its slot is refilled.
        """
        fill = _Fill(self, before_fill)
        for name, tensor in named_tensors:
            t = tensor.detach()
            if not t.is_contiguous():
                t = t.contiguous()  # a copy bounded by this one tensor
            if on_tensor is not None:
                on_tensor(name, t)
            src = t.reshape(-1).view(torch.uint8)
            esize = t.element_size()
            if esize > self.bucket_bytes - self.align:
                raise ValueError(f"bucket of {self.bucket_bytes} bytes cannot hold one element")
            meta = (name, dtype_name(t.dtype), tuple(t.shape))
            if not self.split and not self.zero_copy and src.numel() > self.bucket_bytes:
                yield from self._pack_alone(fill, meta, src)
            else:
                yield from self._pack_pieces(fill, meta, src, esize)
        if fill.pieces:
            yield fill.flush()

    def _pack_alone(
        self, fill: _Fill, meta: tuple[str, str, tuple[int, ...]], src: torch.Tensor
    ) -> Iterator[PackedBucket]:
        """A tensor larger than a bucket, whole and alone in a bucket of its own size (after
        the bucket being filled, if any)."""
        total = src.numel()
        if fill.pieces:
            yield fill.flush()
            fill.next()
        if self.alone_in_place and self.hash_inline and src.device.type == "cpu":
            if fill.before_fill is not None:
                fill.before_fill(fill.slot)  # the transfers in flight stay bounded
            man = Manifest(fill.seq, total, "", [Piece(*meta, 0, total, 0, total)])
            man.set_sums([part_checksum(src)])
            yield PackedBucket(fill.slot, src, man)
            fill.next()
            fill.buf = None
            return
        buf = fill.open(total)
        fill.copy_in(buf[:total], src)
        fill.pieces.append(Piece(*meta, 0, total, 0, total))
        fill.cursor = total
        yield fill.flush()
        fill.next()
        fill.buf = None

    def _pack_pieces(
        self,
        fill: _Fill,
        meta: tuple[str, str, tuple[int, ...]],
        src: torch.Tensor,
        esize: int,
    ) -> Iterator[PackedBucket]:
        """A tensor at aligned offsets of the buckets, split at element boundaries where it
        does not fit (never when it would fit whole in an empty bucket)."""
        total = src.numel()
        done = 0
        while done < total or (total == 0 and done == 0):
            if fill.buf is None:
                fill.open()
            offset = -(-fill.cursor // self.align) * self.align
            room = (
                (self.bucket_bytes - offset) // esize * esize if offset < self.bucket_bytes else 0
            )
            # A tensor that would fit whole in an empty bucket is not split across two.
            unsplit = done == 0 and fill.pieces and total <= self.bucket_bytes and total > room
            if room <= 0 or (total and room < esize) or unsplit:
                yield fill.flush()
                fill.next()
                fill.open()
                continue
            n = min(total - done, room)
            if self.zero_copy:
                fill.sources.append(src[done : done + n])
            elif n:
                assert fill.buf is not None
                fill.copy_in(fill.buf[offset : offset + n], src[done : done + n])
            fill.pieces.append(Piece(*meta, offset, n, done, total))
            fill.cursor = offset + n
            done += n
            if total == 0:
                break


class _Fill:
    """The bucket :meth:`BucketPacker.pack` is filling: its sequence number, slot, buffer,
    bytes used, pieces, source bytes (zero copy) and, hashing inline, the checksum of each piece
    copied so far (by its index; an empty piece is never copied)."""

    def __init__(self, packer: BucketPacker, before_fill: Callable[[int], None] | None) -> None:
        self.packer = packer
        self.before_fill = before_fill
        self.seq = 0
        self.slot = 0
        self.cursor = 0
        self.pieces: list[Piece] = []
        self.sources: list[torch.Tensor] = []
        self.buf: torch.Tensor | None = None
        self.empty = torch.empty(0, dtype=torch.uint8)
        self.inline = False
        self.sums: dict[int, str] = {}

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into the bucket at ``dst``, hashing it chunk by chunk while the chunk
        is still in cache when hashing inline."""
        if not self.inline:
            dst.copy_(src)
            return
        out = dst.numpy()
        h = xxhash.xxh3_64()
        for i in range(0, src.numel(), INLINE_CHUNK):
            dst[i : i + INLINE_CHUNK].copy_(src[i : i + INLINE_CHUNK])
            h.update(out[i : i + INLINE_CHUNK])
        # the piece this copy fills is appended next: it gets the index of the next piece
        self.sums[len(self.pieces)] = h.hexdigest() if src.numel() else EMPTY_CHECKSUM

    def open(self, nbytes: int | None = None) -> torch.Tensor:
        """Take the buffer of the current slot (at least ``nbytes``), once the caller freed
        it; it becomes :attr:`buf`."""
        packer = self.packer
        if packer.zero_copy:
            self.buf = self.empty
            return self.empty
        if self.before_fill is not None:
            self.before_fill(self.slot)
        out = packer.buffer(self.slot, nbytes)
        cpu = out.device.type == "cpu"
        self.inline = packer.hash_inline and cpu
        self.sums = {}
        self.buf = out
        return out

    def flush(self) -> PackedBucket:
        """The filled bucket, its checksum computed (or under way on the hasher)."""
        assert self.buf is not None
        seq, slot, cursor, pieces, hasher = (
            self.seq,
            self.slot,
            self.cursor,
            self.pieces,
            self.packer.hasher,
        )
        man = Manifest(seq, cursor, "", pieces)
        if self.packer.zero_copy:
            srcs = list(self.sources)
            if hasher is None:
                man.set_sums(part_checksums(srcs))
                return PackedBucket(slot, self.empty, man, sources=srcs)
            future = hasher.submit(part_checksums, srcs)
            return PackedBucket(slot, self.empty, man, future, sources=srcs)
        data = self.buf[:cursor]
        if self.inline:
            man.set_sums([self.sums.get(i, EMPTY_CHECKSUM) for i in range(len(pieces))])
            return PackedBucket(slot, data, man)
        if hasher is None:
            man.set_sums(piece_checksums(data, pieces))
            return PackedBucket(slot, data, man)
        return PackedBucket(slot, data, man, hasher.submit(piece_checksums, data, pieces))

    def next(self) -> None:
        """Start the next bucket, in the next slot (the next sequence number when every
        bucket of the update has its own)."""
        num_buffers = self.packer.num_buffers
        self.slot = self.seq + 1 if num_buffers is None else (self.slot + 1) % num_buffers
        self.seq += 1
        self.cursor, self.pieces, self.sources = 0, [], []
