"""The trainer side of the broadcast transport (rank 0 of the group)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from miles_transport_common.bucketing import BucketPacker, Manifest
from miles_transport_common.checksum import combine_digests, tensor_digest
from miles_transport_common.errors import TransportError, TransportTimeout

from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.group import all_status, bcast, bcast_msg, make_group

FaultHook = Callable[[Manifest, torch.Tensor], None]


@contextmanager
def guard(what: str, timeout_s: float) -> Iterator[None]:
    """Turn a failure of a collective into a :class:`TransportError` that says what failed."""
    try:
        yield
    except TransportError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with their own text
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise TransportTimeout(
                f"broadcast transport: {what} timed out after {timeout_s:g} s ({text}); "
                "a peer is missing, dead or too slow"
            ) from exc
        raise TransportError(
            f"broadcast transport: {what} failed ({text}); a receiver probably died. The "
            "group is unusable now: close this sender and build a new one"
        ) from exc


class BroadcastSender:
    """Rank 0 of the transport's group: streams named tensors to every receiver.

    Construction starts the TCP store (the rendezvous) at ``options.host:options.port``;
    :meth:`connect` (called by the first :meth:`send` if needed) waits for the
    ``num_receivers`` receivers to join. ``fault_hook(manifest, data)``, a test hook, is called
    after a bucket's checksum is computed and before it is sent.
    """

    def __init__(self, options: BroadcastOptions, *, fault_hook: FaultHook | None = None) -> None:
        self.options = options
        self.world = 1 + options.num_receivers
        self.device = "cuda" if options.backend == "nccl" else "cpu"
        self.store = dist.TCPStore(
            options.host,
            options.port,
            self.world,
            True,
            timedelta(seconds=options.timeout_s),
            wait_for_workers=False,
        )
        self.address = (options.host, self.store.port)
        self.fault_hook = fault_hook
        self.packer = BucketPacker(
            options.bucket_bytes,
            num_buffers=options.num_buffers,
            device=self.device,
            hash_inline=True,
        )
        self._pg: dist.ProcessGroup | None = None
        self._broken = False

    def connect(self) -> None:
        """Wait for every receiver to join the group (at most ``timeout_s``)."""
        if self._pg is None:
            with guard(
                f"waiting for {self.options.num_receivers} receiver(s)", self.options.timeout_s
            ):
                self._pg = make_group(
                    self.store, 0, self.world, self.options.backend, self.options.timeout_s
                )

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> dict[str, float]:
        """Stream ``weights`` to every receiver and make them commit ``version``.

        Returns timing metrics. Raises :class:`TransportError` (or :class:`TransportTimeout`)
        if any receiver rejected a bucket, failed to load, died or stalled; then no receiver
        committed (all or none), except a receiver whose own load failed at commit time.
        """
        if self._broken:
            raise TransportError("broadcast transport: the group broke earlier; build a new sender")
        self.connect()
        assert self._pg is not None
        pg, dev, opts = self._pg, self.device, self.options
        t0 = time.perf_counter()
        pending: dict[int, dist.Work] = {}
        digests: dict[str, bytes] = {}

        def before_fill(slot: int) -> None:
            work = pending.pop(slot, None)
            if work is not None:
                work.wait()

        def on_tensor(name: str, t: torch.Tensor) -> None:
            digests[name] = tensor_digest(name, t)

        nbuckets = 0
        nbytes = 0
        try:
            with guard(f"update {version}", opts.timeout_s):
                bcast_msg(pg, {"op": "begin", "version": version}, dev)
                for bucket in self.packer.pack(
                    weights,
                    before_fill=before_fill,
                    on_tensor=on_tensor if opts.verify_weights_hash else None,
                ):
                    if self.fault_hook is not None:
                        self.fault_hook(bucket.manifest, bucket.data)
                    if dev == "cuda":
                        torch.cuda.current_stream().synchronize()
                    bcast_msg(pg, {"op": "bucket", **bucket.manifest.to_json()}, dev)
                    pending[bucket.slot] = bcast(pg, bucket.data)
                    nbuckets += 1
                    nbytes += bucket.manifest.nbytes
                for work in pending.values():
                    work.wait()
                pending.clear()
                whash = combine_digests(digests) if opts.verify_weights_hash else None
                bcast_msg(pg, {"op": "end", "buckets": nbuckets, "weights_hash": whash}, dev)
                t_sent = time.perf_counter()
                verified = all_status(pg, 0, self.world, 0, dev)
                if any(verified):
                    bad = [r for r, c in enumerate(verified) if c]
                    raise TransportError(
                        f"broadcast transport: receiver rank(s) {bad} rejected update {version} "
                        "(see their logs for the failed check); no receiver committed it"
                    )
                loaded = all_status(pg, 0, self.world, 0, dev)
                if any(loaded):
                    bad = [r for r, c in enumerate(loaded) if c]
                    raise TransportError(
                        f"broadcast transport: receiver rank(s) {bad} failed to load update "
                        f"{version}; they stay on their previous version"
                    )
        except TransportError as exc:
            if not isinstance(exc, TransportTimeout) and "rejected" in str(exc):
                raise  # the group is still in step: a verification failure is a clean abort
            self._broken = True
            raise
        t1 = time.perf_counter()
        return {
            "sync/seconds": t1 - t0,
            "sync/send_seconds": t_sent - t0,
            "sync/bytes": float(nbytes),
            "sync/buckets": float(nbuckets),
            "sync/gb_per_s": nbytes / max(t1 - t0, 1e-9) / 1e9,
        }

    def close(self) -> None:
        """Release the group and the store."""
        self._pg = None
        self.packer.buffers.clear()


def build(options: BroadcastOptions) -> BroadcastSender:
    """Factory of the registered ``broadcast`` transport: the sending side."""
    return BroadcastSender(options)
