"""The engine side of the broadcast transport (ranks 1..num_receivers of the group)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist
from miles_transport_common.bucketing import Manifest
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.staging import (
    ReceiverState,
    StagingPool,
    Target,
    UpdateStager,
    adopter_of,
    as_loader,
)

from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.group import all_status, bcast, bcast_msg, make_group
from miles_transport_broadcast.sender import guard

log = logging.getLogger(__name__)


class BroadcastReceiver:
    """One engine's end of the broadcast group.

    Joins the group at ``address`` (the sender's ``address``) as ``rank`` (1-based) on its first
    :meth:`receive` (or :meth:`connect`), so building it never blocks an engine's start; each
    :meth:`receive` takes part in one update and commits it into ``target`` only when every
    receiver verified every bucket.
    """

    def __init__(
        self,
        options: BroadcastOptions,
        address: tuple[str, int],
        rank: int,
        *,
        version: int = 0,
    ) -> None:
        if not 1 <= rank <= options.num_receivers:
            raise ValueError(f"receiver rank must be in 1..{options.num_receivers}, got {rank}")
        self.options = options
        self.rank = rank
        self.world = 1 + options.num_receivers
        self.device = "cuda" if options.backend == "nccl" else "cpu"
        self.state = ReceiverState(version=version)
        self.pool = StagingPool(self.device)
        # buckets land in pooled buffers that stay untouched until the update after next, so
        # each one is hashed here while the group already moves the next one
        self.verifier = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-verify")
        self.address = address
        self._pg: dist.ProcessGroup | None = None
        self.last_error: str | None = None

    def connect(self) -> None:
        """Join the group (the sender joins in its first ``send``); at most ``timeout_s``."""
        if self._pg is None:
            with guard("joining the group", self.options.timeout_s):
                store = dist.TCPStore(
                    self.address[0],
                    self.address[1],
                    self.world,
                    False,
                    timedelta(seconds=self.options.timeout_s),
                )
                self._pg = make_group(
                    store, self.rank, self.world, self.options.backend, self.options.timeout_s
                )

    @property
    def version(self) -> int:
        """The weight version the target holds."""
        return self.state.version

    def receive(self, target: Target) -> int:
        """Take part in one update; returns the new version.

        Raises :class:`BucketRejected` when this or another receiver rejected the update, or
        :class:`TransportError` on a broken or silent sender; in every such case ``target`` and
        the version are left as they were (in ``staging="full"``).
        """
        self.connect()
        assert self._pg is not None
        pg, dev, opts = self._pg, self.device, self.options
        self.last_timings: dict[str, float] = {}
        stager = UpdateStager(
            as_loader(target),
            self.state,
            mode=opts.staging,
            device=dev,
            hash_weights=opts.verify_weights_hash,
            pool=self.pool,
            adopt=adopter_of(target),
            verifier=self.verifier,
        )
        error: str | None = None
        with guard("receiving an update", opts.timeout_s):
            begin = bcast_msg(pg, None, dev)
            stager.begin(int(begin["version"]))
            while True:
                msg = bcast_msg(pg, None, dev)
                if msg["op"] == "end":
                    break
                manifest = Manifest.from_json(msg)
                # In full staging each bucket keeps its own buffer (per parity: a model that
                # adopted the last update serves from the other set), and staged whole tensors
                # stay views of it (no copy out); in bucket staging one buffer serves all.
                key = (stager.parity, manifest.seq) if opts.staging == "full" else 0
                data = self.pool.bucket(key, manifest.nbytes)
                bcast(pg, data).wait()
                if error is None:
                    try:
                        stager.add_bucket(manifest, data, owned=True)
                    except (BucketRejected, TransportError) as exc:
                        error = str(exc)  # keep in step with the group until the end
            if error is None:
                try:
                    stager.finish(int(msg["buckets"]), msg.get("weights_hash"))
                except BucketRejected as exc:
                    error = str(exc)
            verdict = all_status(pg, self.rank, self.world, 1 if error else 0, dev)
            if any(verdict):
                stager.abort()
                others = [r for r, c in enumerate(verdict) if c and r != self.rank]
                self.last_error = error or f"receiver rank(s) {others} rejected the update"
                log.error("update %s rejected: %s", stager.version, self.last_error)
                raise BucketRejected(self.last_error)
            load_error: Exception | None = None
            try:
                version = stager.commit()
            except Exception as exc:  # reported to the sender, then raised here
                load_error = exc
            all_status(pg, self.rank, self.world, 1 if load_error else 0, dev)
            if load_error is not None:
                self.last_error = f"loading failed: {load_error}"
                raise TransportError(self.last_error) from load_error
        self.last_error = None
        self.last_timings = dict(stager.timings)
        return version

    def close(self) -> None:
        """Leave the group."""
        self._pg = None
        self.pool.clear()
        self.verifier.shutdown(wait=True)


def build_receiver(
    options: BroadcastOptions, address: tuple[str, int], rank: int
) -> BroadcastReceiver:
    """The engine side, as ``Transport.receiver_factory`` builds it (``rank`` is 1-based)."""
    return BroadcastReceiver(options, address, rank)
