"""Receiver side: verify each bucket, reassemble its tensors, and commit all-or-nothing.

Two staging modes (the ``staging`` option), a memory/atomicity trade-off:

* ``"full"``: every verified tensor is kept staged; the target takes the update only after the
  last bucket arrived, the count matched and (optionally) the weights hash matched. A failed or
  partial update never touches the target: it keeps its weights and version. When the transport
  hands over buffers that stay valid until the update after next (``owned``), staged tensors
  are views of them; otherwise they are copied into the receiver's staging pool.
* ``"bucket"``: each bucket is loaded into the target as soon as it verified, so receiver
  memory stays bounded by a bucket (plus the largest tensor split across buckets). A failure
  mid-update leaves the target partly updated: the version is not bumped and
  :attr:`ReceiverState.consistent` turns False until a later update succeeds.

Commit without a copy. A target that can *adopt* tensors (see :class:`Adoptable`: the engine's
model, :class:`NamedWeights`) takes the staged tensors as its own weights at commit, so the
update costs no load copy. Staged memory therefore alternates between two sets (the *parity*
of the update): the set adopted by the last commit is live, the next update is staged in the
other. The memory is the same as copying (the model plus one staged copy); only the copy goes.

Verification can run on a worker thread (``verifier``) for owned buffers: the receiver takes the
next bucket while the last one is hashed, and :meth:`UpdateStager.finish` waits for every
verdict before anything is committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, MutableMapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from miles_transport_common.bucketing import Manifest, Piece, dtype_from_name
from miles_transport_common.checksum import (
    combine_checksums,
    combine_digests,
    piece_checksums,
    tensor_digest,
)
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.served import ReadServed, TensorSums, check_served

NamedTensors = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[NamedTensors], None]
Target = LoadFn | MutableMapping[str, torch.Tensor] | Any


@runtime_checkable
class Adoptable(Protocol):
    """A target that can take received tensors as its own weights instead of copying them.

    ``adopt(named)`` must check every name, shape, dtype and device first and change nothing
    when one is wrong (raise), then make the model use exactly these tensors. The transport
    keeps their memory untouched until the update after next.
    """

    def adopt(self, named: NamedTensors) -> None: ...


def check_named(current: MutableMapping[str, torch.Tensor], named: NamedTensors) -> None:
    """Raise :class:`TransportError` unless every tensor matches a current one by name, shape
    and dtype (checked for the whole batch before anything changes)."""
    for name, t in named:
        if name not in current:
            raise TransportError(f"the receiver's model has no tensor named {name!r}")
        dst = current[name]
        if dst.shape != t.shape or dst.dtype != t.dtype or dst.device != t.device:
            raise TransportError(
                f"tensor {name!r}: received {t.dtype} {tuple(t.shape)} on {t.device}, the "
                f"receiver's model has {dst.dtype} {tuple(dst.shape)} on {dst.device}"
            )


class NamedWeights:
    """A model held as a name -> tensor dict that can both copy (:meth:`load`) and adopt
    (:meth:`adopt`) an update; ``tensors`` always maps names to the live weights."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def load(self, named: NamedTensors) -> None:
        """Copy ``named`` into the current tensors."""
        check_named(self.tensors, named)
        with torch.no_grad():
            for name, t in named:
                self.tensors[name].copy_(t)

    def __call__(self, named: NamedTensors) -> None:
        self.load(named)

    def adopt(self, named: NamedTensors) -> None:
        """Make ``named`` the live tensors (no copy)."""
        check_named(self.tensors, named)
        for name, t in named:
            self.tensors[name] = t


def module_target(module: torch.nn.Module) -> NamedWeights:
    """A target over a module's parameters and buffers: ``load`` copies into them, ``adopt``
    re-points each one's ``.data`` at the received tensor (tied weights stay tied: they are
    one parameter object)."""
    live = dict(module.state_dict(keep_vars=True))
    target = NamedWeights(live)

    def adopt(named: NamedTensors) -> None:
        check_named(live, named)
        with torch.no_grad():
            for name, t in named:
                live[name].data = t

    target.adopt = adopt  # type: ignore[method-assign]
    return target


def adopter_of(target: Target) -> Callable[[NamedTensors], None] | None:
    """The target's ``adopt`` when it has one."""
    adopt = getattr(target, "adopt", None)
    return adopt if callable(adopt) else None


@dataclass(frozen=True)
class ServedTarget:
    """A target given as its three operations: ``load`` (copy), ``adopt`` (serve from the given
    tensors; None: copy) and ``read`` (the tensors served now, by name), so an update's commit
    can check what the target then serves (:mod:`.served`)."""

    load: LoadFn
    read: ReadServed
    adopt: Callable[[NamedTensors], None] | None = None

    def __call__(self, named: NamedTensors) -> None:
        """``load``: a target is also the ``load(named_tensors)`` callable receivers call."""
        self.load(named)


def reader_of(target: Target) -> ReadServed | None:
    """How to read back what ``target`` serves, by name: a :class:`ServedTarget`'s ``read``,
    or the live tensors of a :class:`NamedWeights` (``module_target`` included) or a mapping;
    None for a bare ``load`` callable (its owner may pass a reader of its own)."""
    if isinstance(target, ServedTarget):
        return target.read
    live: MutableMapping[str, torch.Tensor]
    if isinstance(target, NamedWeights):
        live = target.tensors
    elif isinstance(target, MutableMapping):
        live = target
    else:
        return None
    return lambda names: {n: live[n] for n in names if n in live}


def as_loader(target: Target) -> LoadFn:
    """Turn a target into a ``load(named_tensors)`` callable.

    A callable is used as is; an object with a ``load`` method (:class:`NamedWeights`) through
    it. A mapping (a ``state_dict`` whose tensors share storage with the model, or any name ->
    tensor dict) is loaded with ``copy_`` after checking, for the whole batch first, that every
    name exists with the same shape and dtype, so a mismatch changes nothing.
    """
    if callable(target):
        return target  # type: ignore[no-any-return]
    if callable(getattr(target, "load", None)):
        return target.load  # type: ignore[no-any-return]
    mapping = target

    def load(named: NamedTensors) -> None:
        check_named(mapping, named)
        with torch.no_grad():
            for name, t in named:
                mapping[name].copy_(t)

    return load


class StagingPool:
    """Staging memory a receiver keeps from one update to the next.

    Allocating fresh staging memory for every update costs a page fault per 4 KiB page, which
    runs slower than the copies themselves; a pool reuses the buffers of an earlier update when
    keys and sizes match. Keys carry the update's parity when the target adopts, so the set
    being staged is never the set the model serves from. ``on_new(tensor)`` is called for each
    buffer allocated (a transport registers it with its network library there).
    """

    def __init__(
        self, device: str = "cpu", on_new: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        self.device = device
        self.on_new = on_new
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._buckets: dict[Hashable, torch.Tensor] = {}

    def _new(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.on_new is not None:
            self.on_new(t)
        return t

    def tensor(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """A flat uint8 staging tensor of ``nbytes`` for ``key`` (a tensor name, with parity)."""
        t = self._tensors.get(key)
        if t is None or t.numel() != nbytes:
            t = self._tensors[key] = self._new(nbytes)
        return t

    def bucket(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` to receive bucket ``key`` into."""
        t = self._buckets.get(key)
        if t is None or t.numel() < nbytes:
            t = self._buckets[key] = self._new(nbytes)
        return t[:nbytes]

    def clear(self) -> None:
        """Free everything."""
        self._tensors.clear()
        self._buckets.clear()


@dataclass
class ReceiverState:
    """What a receiver serves: the weight version, whether its weights are whole, and which
    staging set (0 or 1) the model serves from after an adopting commit."""

    version: int = 0
    consistent: bool = True
    live_parity: int = 1  # the first update stages in set 0

    @property
    def staging_parity(self) -> int:
        """The set the next update is staged in."""
        return 1 - self.live_parity


class UpdateStager:
    """Collects the buckets of one update and commits them to the target.

    Args:
        load: the loader of the target (see :func:`as_loader`).
        state: the receiver's state, changed only by a successful :meth:`commit`.
        mode: ``"full"`` or ``"bucket"`` (see the module docstring).
        device: where reassembled and staged tensors live.
        hash_weights: compute the weights hash of what arrived (to compare with the sender's).
        pool: staging memory kept across updates (see :class:`StagingPool`).
        adopt: the target's ``adopt`` (see :class:`Adoptable`); ``None``: commit copies.
        verifier: an executor to hash owned buckets on while the next one arrives.
        read_served: reads the target's tensors back by name; given, :meth:`commit` checks
            that the target serves exactly what the sender sent (:mod:`.served`).
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
        adopt: Callable[[NamedTensors], None] | None = None,
        verifier: Executor | None = None,
        read_served: ReadServed | None = None,
    ) -> None:
        self.load = load
        self.read_served = read_served
        #: the checksum of what the target serves for the last committed update (None: no
        #: reader, or a sender that sent no per-piece checksums)
        self.served_checksum: str | None = None
        self.adopt = adopt if mode == "full" else None
        self.verifier = verifier
        self.pool = pool or StagingPool(device)
        self.state = state
        self.mode = mode
        self.device = device
        self.hash_weights = hash_weights
        self.version: int | None = None
        self.begin(0)
        self.version = None

    @property
    def parity(self) -> int:
        """The staging set of this update (pool keys carry it when the target adopts)."""
        return self.state.staging_parity if self.adopt is not None else 0

    def begin(self, version: int) -> None:
        """Start collecting update ``version``; forgets anything staged before."""
        self.version = version
        self._next_seq = 0
        self._staged: NamedTensors = []
        self._partial: dict[str, tuple[torch.Tensor, int, Piece]] = {}
        self._digests: dict[str, bytes] = {}
        self._pending: list[tuple[Manifest, Future[list[str]]]] = []
        #: the sender's checksum of each tensor, and the staged tensors whose own memory is
        #: hashed on arrival (the served check trusts those when the target serves them)
        self.sums = TensorSums()
        self._verified: dict[str, torch.Tensor] = {}
        self.received_bytes = 0
        #: seconds spent verifying checksums, staging (copies, reassembly), loading, and
        #: checking what the target serves after the load
        self.timings = {"verify_s": 0.0, "stage_s": 0.0, "load_s": 0.0, "served_s": 0.0}

    def _timed_checksum(self, data: torch.Tensor, pieces: list[Piece]) -> list[str]:
        t0 = time.perf_counter()
        got = piece_checksums(data, pieces)
        self.timings["verify_s"] += time.perf_counter() - t0
        return got

    def _check(self, manifest: Manifest, got: list[str]) -> None:
        """Raise :class:`BucketRejected` naming the tensors whose bytes arrived changed."""
        if manifest.sums:
            bad = [
                f"{p.name!r} (bytes {p.start}..{p.start + p.nbytes}): checksum {g} != {s} sent"
                for p, g, s in zip(manifest.pieces, got, manifest.sums, strict=True)
                if g != s
            ]
            if not bad:
                return
            raise BucketRejected(
                f"bucket {manifest.seq} of update {self.version}: tensor {'; '.join(bad[:3])}; "
                "the update is rejected"
            )
        combined = combine_checksums(got)
        if combined != manifest.checksum:
            raise BucketRejected(
                f"bucket {manifest.seq} of update {self.version}: checksum {combined} != "
                f"{manifest.checksum} sent; the update is rejected"
            )

    def add_bucket(self, manifest: Manifest, data: torch.Tensor, *, owned: bool = False) -> None:
        """Verify one bucket (now, or on the verifier thread) and take its tensors.

        ``data`` holds the bucket's bytes; ``owned`` says the transport leaves that buffer
        untouched until the update after next, so whole tensors may stay views of it (and be
        adopted) instead of being copied out, and it may be verified later. Raises
        :class:`BucketRejected` when the sequence, size or (verified now) checksum is wrong.
        """
        if manifest.seq != self._next_seq:
            raise BucketRejected(f"bucket {manifest.seq} arrived, expected {self._next_seq}")
        if data.numel() != manifest.nbytes:
            raise BucketRejected(
                f"bucket {manifest.seq}: {data.numel()} bytes arrived, manifest says "
                f"{manifest.nbytes}"
            )
        t1 = time.perf_counter()
        if owned and self.verifier is not None and self.mode == "full":
            future = self.verifier.submit(self._timed_checksum, data, manifest.pieces)
            self._pending.append((manifest, future))
        else:
            self._check(manifest, self._timed_checksum(data, manifest.pieces))
            t1 = time.perf_counter()
        self.sums.add_manifest(manifest)
        self._next_seq += 1
        self.received_bytes += manifest.nbytes
        parity = self.parity
        ready: NamedTensors = []
        for p in manifest.pieces:
            dtype = dtype_from_name(p.dtype)
            chunk = data[p.offset : p.offset + p.nbytes]
            if p.whole:
                if not owned and self.mode == "full":
                    chunk = self.pool.tensor((parity, p.name), p.total).copy_(chunk)
                ready.append((p.name, chunk.view(dtype).view(p.shape)))
                if owned and self.mode == "full":  # a view of the bytes the checksum reads
                    self._verified[p.name] = ready[-1][1]
                continue
            if p.start == 0:
                if self.mode == "full":
                    dest = self.pool.tensor((parity, p.name), p.total)
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
        """Wait for every deferred verification; check that the update is complete (and its
        weights hash, when given). Raises :class:`BucketRejected` otherwise."""
        pending, self._pending = self._pending, []
        for manifest, future in pending:
            self._check(manifest, future.result())
        if self._next_seq != num_buckets:
            raise BucketRejected(f"{self._next_seq} of {num_buckets} buckets arrived")
        if self._partial:
            raise BucketRejected(f"tensors left incomplete: {sorted(self._partial)}")
        if weights_hash is not None and self.hash_weights:
            got = combine_digests(self._digests)
            if got != weights_hash:
                raise BucketRejected(f"weights hash {got} != {weights_hash} sent")

    def commit(self) -> int:
        """Hand what was staged to the target (adopted, or loaded by copy), check what it now
        serves (with ``read_served``), and bump the version; returns the new version. A target
        that serves other tensors than the sender sent is a :class:`~.served.ServedMismatch`
        naming them: the version stays, and the receiver is marked inconsistent."""
        if self.version is None:
            raise TransportError("commit without an update in progress")
        if self.mode == "full":
            t0 = time.perf_counter()
            if self.adopt is not None:
                self.adopt(self._staged)
                self.state.live_parity = self.parity
            else:
                self.load(self._staged)
            self.timings["load_s"] += time.perf_counter() - t0
        self._staged = []
        self.served_checksum = None
        if self.read_served is not None and self.sums.spans:
            t0 = time.perf_counter()
            try:
                self.served_checksum = check_served(
                    self.sums, self.read_served, self._verified, self.version
                )
            except BucketRejected:
                self.state.consistent = False
                raise
            finally:
                self.timings["served_s"] += time.perf_counter() - t0
        self._verified = {}
        self.state.version = self.version
        self.state.consistent = True
        return self.version

    def abort(self) -> None:
        """Drop everything staged; the target and version stay as they were."""
        for _, future in self._pending:
            future.cancel()
        self._pending = []
        self._staged = []
        self._partial = {}
        self.version = None

    def weights_hash(self) -> str:
        """Weights hash of what arrived in this update (needs ``hash_weights``)."""
        return combine_digests(self._digests)
