"""The engine side of SGLang's weight-update endpoints, with Miles's guarantees.

An engine that embeds these (Miles's embedded engine, and the test stand-in of
:mod:`.testing`) serves ``POST /update_weights_from_tensor`` (colocated),
``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed`` (broadcast)
with SGLang's request bodies, and adds what SGLang does not do: every bucket is verified, and an
update becomes visible all at once, with its version, or not at all.

Colocated (:class:`TensorUpdates`). Each ``flattened_bucket`` item may carry a ``"miles"``
header (:mod:`.payload`; SGLang ignores it) with the protocol step:

* ``bucket`` (``version``, ``manifest``, ``owned``, ``staging``): the bucket is staged and its
  checksum verified (on a worker thread when ``owned``: the sender leaves that memory untouched
  until the update after next, so the staged tensors stay views of it, zero copy); bucket 0
  starts a new update and forgets anything staged before;
* ``end`` (``buckets``, ``weights_hash``): wait for every verdict, check the count (and the
  weights hash); a failure answers 400 and drops the update;
* ``commit``: the staged tensors become the served weights (adopted, no copy, when the target
  can) and the version is set; ``abort``: drop what is staged.

An item without the header is loaded at once, as SGLang does.

Broadcast (:class:`DistributedUpdates`). A ``flattened_bucket`` call *without*
``weight_version`` receives the bucket from rank 0 into staging memory and hashes it; a call
with ``names == []`` and no ``weight_version`` (the sender's *end*) answers the checksums of
every staged bucket, which the sender compares with its own; the call that carries
``weight_version`` commits everything staged (plus its own tensors) and sets the version. A call
with ``load_format`` unset and tensors is loaded at once, as SGLang does. Forming a group drops
what is staged, so a sender that gave up on an update (a checksum mismatch, a dead peer) forms a
new group and nothing of the abandoned update can ever be committed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from miles_transport_common.bucketing import Manifest, Piece, dtype_from_name, tight_pieces
from miles_transport_common.checksum import combine_checksums, piece_checksums
from miles_transport_common.errors import BucketRejected, TransportError, TransportTimeout
from miles_transport_common.groups import join_update_group, leave_update_group
from miles_transport_common.payload import deserialize, read_bucket, reconstruct
from miles_transport_common.served import ReadServed, TensorSums, check_served
from miles_transport_common.staging import (
    NamedTensors,
    ReceiverState,
    StagingPool,
    Target,
    UpdateStager,
    adopter_of,
    as_loader,
    reader_of,
)

#: Called with the new version string after a commit (the engine stamps it on generations).
SetVersion = Callable[[str | None], None]

#: A weight version as the protocol forms it: the transports send integers as strings
#: (``str(version)``), SGLang's callers may name versions (``/update_weights_from_disk``,
#: ``/update_weight_version``); either way 1 to 64 letters, digits and ``._:+-``, so no space,
#: control character or markup ends up stamped on every generation and log line.
VERSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}")


def check_version(version: object) -> None:
    """Raise :class:`BucketRejected` (a 400) unless ``version`` is None or matches
    :data:`VERSION_PATTERN`. Called before anything of an update is loaded."""
    if version is not None and (
        not isinstance(version, str) or not VERSION_PATTERN.fullmatch(version)
    ):
        raise BucketRejected(
            f"weight_version {str(version)[:80]!r} refused: allowed 1 to 64 characters of "
            "letters, digits and ._:+- starting with a letter or digit"
        )


def named_tensors(item: object) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) entries of a ``direct`` item; anything else in it (a non-tensor
    value, a non-string name, a malformed entry) or no entry at all is a
    :class:`BucketRejected`: an update that loads nothing must not succeed."""
    if not isinstance(item, (list, tuple)):
        raise BucketRejected("the item must be a list of (name, tensor)")
    named = []
    for entry in item:
        if not (
            isinstance(entry, (list, tuple))
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], torch.Tensor)
        ):
            raise BucketRejected(
                f"every entry must be (name: str, tensor), got {type(entry).__name__} "
                f"{str(entry)[:60]!r}"
            )
        named.append((entry[0], entry[1]))
    if not named:
        raise BucketRejected("the update holds no weight; an empty update is refused")
    return named


class TensorUpdates:
    """The engine side of ``POST /update_weights_from_tensor`` for one single-rank engine.

    Calls must not overlap (the embedding server serializes them); ``target`` is what the
    staging layer loads into (``load`` / ``adopt``, see :mod:`.staging`)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.state = ReceiverState()
        self.pool = StagingPool(device)
        self.verifier = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-verify")
        self.stager: UpdateStager | None = None
        self._lock = threading.Lock()
        # The shared bucket buffers of the last two updates stay mapped: the sender packs every
        # other update into the same buffers, and mapping them again costs a page fault per
        # page (more than the copy the zero-copy hand-off saves).
        self._held: list[list[torch.Tensor]] = [[], []]
        #: seconds the last update spent verifying / staging / loading on this engine
        self.last_timings: dict[str, float] = {}

    def handle(
        self,
        items: Sequence[str],
        target: Target,
        *,
        load_format: str | None,
        weight_version: str | None,
        set_version: SetVersion,
        read_served: ReadServed | None = None,
    ) -> dict[str, Any]:
        """Serve one call; returns the JSON answer. Raises :class:`BucketRejected` (a 400) when
        the call is refused; the served weights and version are then unchanged.
        ``read_served`` reads the target's tensors back by name (default: the target's own,
        when it is a :class:`~.staging.NamedWeights` or a mapping): a commit then checks that
        the target serves what the sender sent (:mod:`.served`) and answers its
        ``weights_checksum``."""
        if len(items) != 1:
            raise BucketRejected(
                f"this engine has one rank: send exactly one serialized item, got {len(items)}"
            )
        check_version(weight_version)
        with self._lock:
            try:
                item = deserialize(items[0])
            except Exception as exc:
                raise BucketRejected(f"cannot decode serialized_named_tensors: {exc!r}") from None
            if load_format == "flattened_bucket":
                flat, metadata, header = read_bucket(item)
                if header is not None:
                    read = read_served or reader_of(target)
                    return self._step(header, flat, target, weight_version, set_version, read)
                named = reconstruct(flat, metadata)
            elif load_format in (None, "direct"):
                named = named_tensors(item)
            else:
                raise BucketRejected(
                    f"load_format {load_format!r} is not supported; allowed: None, 'direct', "
                    "'flattened_bucket'"
                )
            if not named:
                raise BucketRejected("the update holds no weight; an empty update is refused")
            self._drop()  # a plain load ends any staged update: it is now stale
            as_loader(target)(named)
            set_version(weight_version)
            return {"success": True, "message": f"Succeeded to update {len(named)} weights."}

    def _drop(self) -> None:
        if self.stager is not None:
            self.stager.abort()
            self.stager = None

    def _step(
        self,
        header: dict[str, Any],
        flat: torch.Tensor,
        target: Target,
        weight_version: str | None,
        set_version: SetVersion,
        read_served: ReadServed | None,
    ) -> dict[str, Any]:
        op = header.get("op")
        version = int(header.get("version", 0))
        if op == "bucket":
            manifest = Manifest.from_json(header["manifest"])
            if manifest.seq == 0:
                self._drop()
                self._held = [self._held[1], []]
                mode = str(header.get("staging", "full"))
                self.stager = UpdateStager(
                    as_loader(target),
                    self.state,
                    mode=mode,
                    device=self.device,
                    hash_weights=bool(header.get("weights_hash")),
                    pool=self.pool,
                    adopt=adopter_of(target),
                    verifier=self.verifier,
                    read_served=read_served if header.get("verify_served", True) else None,
                )
                self.stager.begin(version)
            stager = self._current(version, op)
            self._held[1].append(flat)
            if manifest.nbytes > flat.numel():
                self._drop()
                raise BucketRejected(
                    f"bucket {manifest.seq}: {flat.numel()} bytes arrived, manifest says "
                    f"{manifest.nbytes}"
                )
            try:
                stager.add_bucket(
                    manifest, flat[: manifest.nbytes], owned=bool(header.get("owned"))
                )
            except TransportError:
                self._drop()
                raise
            return {"success": True, "message": f"bucket {manifest.seq} staged"}
        if op == "end":
            stager = self._current(version, op)
            try:
                stager.finish(int(header["buckets"]), header.get("weights_hash"))
            except TransportError:
                self._drop()
                raise
            return {"success": True, "message": f"update {version} verified"}
        if op == "commit":
            stager = self._current(version, op)
            try:
                stager.commit()
            except Exception as exc:
                self._drop()
                raise BucketRejected(f"loading update {version} failed: {exc}") from exc
            self.last_timings = dict(stager.timings)
            self.stager = None
            set_version(weight_version if weight_version is not None else str(version))
            out: dict[str, Any] = {"success": True, "message": f"update {version} committed"}
            if stager.served_checksum is not None:
                out["weights_checksum"] = stager.served_checksum
            return out
        if op == "abort":
            self._drop()
            return {"success": True, "message": f"update {version} aborted"}
        raise BucketRejected(f"unknown step {op!r} in the miles header")

    def _current(self, version: int, op: str) -> UpdateStager:
        stager = self.stager
        if stager is None or stager.version != version:
            raise BucketRejected(
                f"{op} of update {version}, but no such update is in progress here (a bucket "
                "was lost, or the engine restarted); the update is rejected"
            )
        return stager

    def close(self) -> None:
        """Drop what is staged and stop the verifier thread."""
        self._drop()
        self.pool.clear()
        self.verifier.shutdown(wait=True)


class DistributedUpdates:
    """The engine side of ``/init_weights_update_group`` and ``/update_weights_from_distributed``
    for one single-rank engine (see the module docstring). Calls must not overlap."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.groups: dict[str, Any] = {}
        self.state = ReceiverState()
        self.pool = StagingPool(device)
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-verify")
        self._staged: NamedTensors = []
        #: per flattened bucket staged: its pieces and their checksums (hashed on arrival)
        self._pieces: list[list[Piece]] = []
        self._checksums: list[Future[list[str]]] = []
        #: staged tensors that are views of the hashed bucket bytes
        self._verified: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        #: joins started; a join's group is kept only if no later join started meanwhile
        self._joins = 0

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join the group (blocks until every rank joined). A new group replaces every earlier
        one (this engine serves one trainer) and drops what was staged."""
        with self._lock:
            self._drop()
            for old in self.groups.values():
                leave_update_group(old)
            self.groups.clear()
            self._joins += 1
            join_id = self._joins
        # torch's store client can wait on a peer that accepted the connection but never
        # answers well past the store's timeout, so the join runs in a thread of its own and the
        # call gives up at the deadline: no lock is held meanwhile, and a join that finishes
        # after it was given up (or after a newer one started) leaves its group at once.
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def join() -> None:
            try:
                outcome["pg"] = join_update_group(
                    master_address=master_address,
                    master_port=master_port,
                    rank=rank_offset,
                    world_size=world_size,
                    group_name=group_name,
                    backend=backend,
                    timeout_s=timeout_s,
                )
            except BaseException as exc:  # handed to the caller
                outcome["error"] = exc
            with self._lock:
                pg = outcome.get("pg")
                if pg is not None:
                    if join_id == self._joins and not outcome.get("given_up"):
                        self.groups[group_name] = pg
                    else:
                        leave_update_group(pg)
                outcome["finished"] = True
            done.set()

        threading.Thread(target=join, name="miles-join-update-group", daemon=True).start()
        done.wait(timeout_s * 1.1)
        with self._lock:  # decided under the lock: either the join finished or it is given up
            if not outcome.get("finished"):
                outcome["given_up"] = True
                raise TransportTimeout(
                    f"joining weight-update group {group_name!r} at "
                    f"{master_address}:{master_port} took longer than dist_timeout "
                    f"({timeout_s:g} s): the rendezvous accepted but did not answer"
                )
        if "error" in outcome:
            raise outcome["error"]

    def _drop(self) -> None:
        for f in self._checksums:
            f.cancel()
        self._checksums = []
        self._pieces = []
        self._verified = {}
        self._staged = []

    def _broadcast(self, pg: Any, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([t], opts).wait()

    def handle(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        target: Target,
        set_version: SetVersion,
        read_served: ReadServed | None = None,
    ) -> dict[str, Any]:
        """Serve one ``/update_weights_from_distributed`` call; returns the JSON answer. Raises
        :class:`BucketRejected` when refused before anything was received, and
        :class:`TransportError` when the group failed (the sender must form a new one).
        The *end* call answers each bucket's checksum and its pieces' (``sums``); with
        ``read_served`` (default: the target's own, see :func:`~.staging.reader_of`) the commit
        checks what the target then serves (:mod:`.served`) and answers its
        ``weights_checksum``."""
        check_version(weight_version)
        with self._lock:
            pg = self.groups.get(group_name)
            if pg is None:
                raise BucketRejected(
                    f"no weight update group {group_name!r}; call /init_weights_update_group first"
                )
            try:
                pieces = tight_pieces(names, dtypes, shapes)
            except (ValueError, TypeError) as exc:
                raise BucketRejected(str(exc)) from None
            if load_format not in (None, "flattened_bucket"):
                raise BucketRejected(
                    f"load_format {load_format!r} is not supported; allowed: None, "
                    "'flattened_bucket'"
                )
            if load_format is None and names and weight_version is None:
                # SGLang's own path: one broadcast per tensor, loaded at once
                named = self._receive_each(pg, pieces)
                self._drop()
                as_loader(target)(named)
                set_version(None)
                return {"success": True, "message": f"Succeeded to update {len(named)} weights."}
            if names:
                if load_format == "flattened_bucket":
                    self._receive_bucket(pg, pieces)
                else:
                    self._staged.extend(self._receive_each(pg, pieces))
            if weight_version is None:
                sums = [f.result() for f in self._checksums]
                return {
                    "success": True,
                    "message": f"{len(sums)} bucket(s) staged",
                    "checksums": [combine_checksums(x) for x in sums],
                    "sums": sums,
                }
            return self._commit(
                target, weight_version, set_version, read_served or reader_of(target)
            )

    def _commit(
        self,
        target: Target,
        weight_version: str,
        set_version: SetVersion,
        read_served: ReadServed | None,
    ) -> dict[str, Any]:
        """Load everything staged into ``target``, check what it serves, set the version."""
        sums = TensorSums()
        for pieces, future in zip(self._pieces, self._checksums, strict=True):
            sums.add(pieces, future.result())
        staged, verified = self._staged, self._verified
        self._staged, self._checksums, self._pieces, self._verified = [], [], [], {}
        adopt = adopter_of(target)
        try:
            if adopt is not None:
                adopt(staged)
                self.state.live_parity = self.state.staging_parity
            else:
                as_loader(target)(staged)
        except Exception as exc:
            raise BucketRejected(f"loading the update failed: {exc}") from exc
        msg = f"Succeeded to update {len(staged)} weights."
        out: dict[str, Any] = {"success": True, "message": msg}
        if read_served is not None and sums.spans:
            try:
                out["weights_checksum"] = check_served(sums, read_served, verified, weight_version)
            except BucketRejected:
                self.state.consistent = False
                raise
        set_version(weight_version)
        return out

    def _receive_each(self, pg: Any, pieces: list[Piece]) -> NamedTensors:
        out = []
        for p in pieces:
            t = torch.empty(p.shape, dtype=dtype_from_name(p.dtype), device=self.device)
            try:
                self._broadcast(pg, t)
            except Exception as exc:
                self._drop()
                raise TransportError(f"receiving {p.name!r} failed: {exc}") from exc
            out.append((p.name, t))
        return out

    def _receive_bucket(self, pg: Any, pieces: list[Piece]) -> None:
        seq = len(self._checksums)
        total = sum(p.nbytes for p in pieces)
        # Each bucket of an update has its own buffer, per staging set: a model that adopted
        # the last update serves from the other set while this one lands.
        data = self.pool.bucket((self.state.staging_parity, seq), total)
        try:
            self._broadcast(pg, data)
        except Exception as exc:
            self._drop()
            raise TransportError(f"receiving bucket {seq} failed: {exc}") from exc
        self._checksums.append(self.hasher.submit(piece_checksums, data, pieces))
        self._pieces.append(pieces)
        for p in pieces:
            chunk = data[p.offset : p.offset + p.nbytes]
            dtype = dtype_from_name(p.dtype)
            view = True
            if chunk.storage_offset() % torch.empty(0, dtype=dtype).element_size():
                chunk = self.pool.tensor((self.state.staging_parity, p.name), p.nbytes).copy_(chunk)
                view = False
            self._staged.append((p.name, chunk.view(dtype).view(p.shape)))
            if view:  # the bytes the checksum reads
                self._verified[p.name] = self._staged[-1][1]

    def close(self) -> None:
        """Leave the groups and free the staging memory."""
        self._drop()
        for pg in self.groups.values():
            leave_update_group(pg)
        self.groups.clear()
        self.pool.clear()
        self.hasher.shutdown(wait=True)
