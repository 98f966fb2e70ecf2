"""Receiver side: verify each bucket, reassemble its tensors, and commit all-or-nothing.

Two staging modes (the ``staging`` option), a memory/atomicity trade-off:

* ``"full"``: every verified tensor is kept in a staging copy; the target is loaded only after
  the last bucket arrived, the count matched and (optionally) the weights hash matched. A failed
  or partial update never touches the target: it keeps its weights and version. Cost: one extra
  copy of the model in receiver memory for the duration of the update (when the transport hands
  over a fresh buffer per bucket, the staged tensors are views of it and no copy is made).
* ``"bucket"``: each bucket is loaded into the target as soon as it verified, so receiver
  memory stays bounded by a bucket (plus the largest tensor split across buckets). A failure
  mid-update leaves the target partly updated: the version is not bumped and
  :attr:`ReceiverState.consistent` turns False until a later update succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import torch

from miles_transport_common.bucketing import Manifest, Piece, dtype_from_name
from miles_transport_common.checksum import bucket_checksum, combine_digests, tensor_digest
from miles_transport_common.errors import BucketRejected, TransportError

NamedTensors = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[NamedTensors], None]
Target = LoadFn | MutableMapping[str, torch.Tensor]


def as_loader(target: Target) -> LoadFn:
    """Turn a target into a ``load(named_tensors)`` callable.

    A callable is used as is. A mapping (a ``state_dict`` whose tensors share storage with the
    model, or any name -> tensor dict) is loaded with ``copy_`` after checking, for the whole
    batch first, that every name exists with the same shape and dtype, so a mismatch changes
    nothing.
    """
    if callable(target):
        return target
    mapping = target

    def load(named: NamedTensors) -> None:
        for name, t in named:
            if name not in mapping:
                raise TransportError(f"the receiver's model has no tensor named {name!r}")
            dst = mapping[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise TransportError(
                    f"tensor {name!r}: received {t.dtype} {tuple(t.shape)}, the receiver's "
                    f"model has {dst.dtype} {tuple(dst.shape)}"
                )
        with torch.no_grad():
            for name, t in named:
                mapping[name].copy_(t)

    return load


class StagingPool:
    """Staging memory a receiver keeps from one update to the next.

    Allocating fresh staging memory for every update costs a page fault per 4 KiB page, which
    runs slower than the copies themselves; a pool reuses the buffers of the previous update
    when names and sizes match. In ``"full"`` staging the pool holds one model copy between
    updates (the same memory an update needs anyway); in ``"bucket"`` staging it holds one
    bucket.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}
        self._buckets: dict[int, torch.Tensor] = {}

    def tensor(self, name: str, nbytes: int) -> torch.Tensor:
        """A flat uint8 staging tensor of ``nbytes`` for tensor ``name``."""
        t = self._tensors.get(name)
        if t is None or t.numel() != nbytes:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._tensors[name] = t
        return t

    def bucket(self, key: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` to receive bucket ``key`` into."""
        t = self._buckets.get(key)
        if t is None or t.numel() < nbytes:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buckets[key] = t
        return t[:nbytes]

    def clear(self) -> None:
        """Free everything."""
        self._tensors.clear()
        self._buckets.clear()


@dataclass
class ReceiverState:
    """What a receiver serves: the weight version and whether its weights are whole."""

    version: int = 0
    consistent: bool = True


class UpdateStager:
    """Collects the buckets of one update and commits them to the target.

    Args:
        load: the loader of the target (see :func:`as_loader`).
        state: the receiver's state, changed only by a successful :meth:`commit`.
        mode: ``"full"`` or ``"bucket"`` (see the module docstring).
        device: where reassembled and staged tensors live.
        hash_weights: compute the weights hash of what arrived (to compare with the sender's).
        pool: staging memory kept across updates (see :class:`StagingPool`).
    """

    def __init__(
        self,
        load: LoadFn,
        state: ReceiverState,
        *,
        mode: str = "full",
        device: str = "cpu",
        hash_weights: bool = False,
        pool: StagingPool | None = None,
    ) -> None:
        self.load = load
        self.pool = pool or StagingPool(device)
        self.state = state
        self.mode = mode
        self.device = device
        self.hash_weights = hash_weights
        self.version: int | None = None
        self._next_seq = 0
        self._staged: NamedTensors = []
        self._partial: dict[str, tuple[torch.Tensor, int, Piece]] = {}
        self._digests: dict[str, bytes] = {}
        self.received_bytes = 0
        #: seconds spent verifying checksums, staging (copies, reassembly) and loading
        self.timings = {"verify_s": 0.0, "stage_s": 0.0, "load_s": 0.0}

    def begin(self, version: int) -> None:
        """Start collecting update ``version``; forgets anything staged before."""
        self.version = version
        self._next_seq = 0
        self._staged = []
        self._partial = {}
        self._digests = {}
        self.received_bytes = 0
        self.timings = {"verify_s": 0.0, "stage_s": 0.0, "load_s": 0.0}

    def add_bucket(self, manifest: Manifest, data: torch.Tensor, *, owned: bool = False) -> None:
        """Verify one bucket and take its tensors.

        ``data`` holds the bucket's bytes; ``owned`` says the transport will not reuse that
        buffer, so whole tensors may stay views of it instead of being copied out. Raises
        :class:`BucketRejected` when the sequence, size or checksum is wrong.
        """
        if manifest.seq != self._next_seq:
            raise BucketRejected(f"bucket {manifest.seq} arrived, expected {self._next_seq}")
        if data.numel() != manifest.nbytes:
            raise BucketRejected(
                f"bucket {manifest.seq}: {data.numel()} bytes arrived, manifest says "
                f"{manifest.nbytes}"
            )
        t0 = time.perf_counter()
        got = bucket_checksum(data)
        t1 = time.perf_counter()
        self.timings["verify_s"] += t1 - t0
        if got != manifest.checksum:
            raise BucketRejected(
                f"bucket {manifest.seq} of update {self.version}: checksum {got} != "
                f"{manifest.checksum} sent; the update is rejected"
            )
        self._next_seq += 1
        self.received_bytes += manifest.nbytes
        ready: NamedTensors = []
        for p in manifest.pieces:
            dtype = dtype_from_name(p.dtype)
            chunk = data[p.offset : p.offset + p.nbytes]
            if p.whole:
                if not owned and self.mode == "full":
                    chunk = self.pool.tensor(p.name, p.total).copy_(chunk)
                ready.append((p.name, chunk.view(dtype).view(p.shape)))
                continue
            if p.start == 0:
                if self.mode == "full":
                    dest = self.pool.tensor(p.name, p.total)
                else:  # not pooled: bucket staging keeps no model-sized memory
                    dest = torch.empty(p.total, dtype=torch.uint8, device=self.device)
                self._partial[p.name] = (dest, 0, p)
            if p.name not in self._partial:
                raise BucketRejected(f"bucket {manifest.seq}: piece of {p.name!r} out of order")
            dest, filled, first = self._partial[p.name]
            if p.start != filled:
                raise BucketRejected(f"bucket {manifest.seq}: piece of {p.name!r} out of order")
            dest[p.start : p.start + p.nbytes].copy_(chunk)
            filled += p.nbytes
            if filled == p.total:
                del self._partial[p.name]
                ready.append((p.name, dest.view(dtype).view(first.shape)))
            else:
                self._partial[p.name] = (dest, filled, first)
        if self.hash_weights:
            for name, t in ready:
                self._digests[name] = tensor_digest(name, t)
        t2 = time.perf_counter()
        self.timings["stage_s"] += t2 - t1
        if self.mode == "bucket":
            if ready:
                self.state.consistent = False  # until the update commits
                self.load(ready)
            self.timings["load_s"] += time.perf_counter() - t2
        else:
            self._staged.extend(ready)

    def finish(self, num_buckets: int, weights_hash: str | None = None) -> None:
        """Check that the update is complete (and its weights hash, when given); raises
        :class:`BucketRejected` otherwise."""
        if self._next_seq != num_buckets:
            raise BucketRejected(f"{self._next_seq} of {num_buckets} buckets arrived")
        if self._partial:
            raise BucketRejected(f"tensors left incomplete: {sorted(self._partial)}")
        if weights_hash is not None and self.hash_weights:
            got = combine_digests(self._digests)
            if got != weights_hash:
                raise BucketRejected(f"weights hash {got} != {weights_hash} sent")

    def commit(self) -> int:
        """Load what was staged and bump the version; returns the new version."""
        if self.version is None:
            raise TransportError("commit without an update in progress")
        if self.mode == "full":
            t0 = time.perf_counter()
            self.load(self._staged)
            self.timings["load_s"] += time.perf_counter() - t0
        self._staged = []
        self.state.version = self.version
        self.state.consistent = True
        return self.version

    def abort(self) -> None:
        """Drop everything staged; the target and version stay as they were."""
        self._staged = []
        self._partial = {}
        self.version = None

    def weights_hash(self) -> str:
        """Weights hash of what arrived in this update (needs ``hash_weights``)."""
        return combine_digests(self._digests)
