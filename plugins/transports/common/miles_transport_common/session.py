"""The update protocol of the transports whose control messages go over a TCP side channel
(colocated, p2p); only how a bucket's bytes reach the receiver differs between them.

Sender → each receiver: ``begin``; per bucket ``bucket`` (manifest + where the bytes are);
``end`` (bucket count, optional weights hash); then ``commit`` or ``abort``. A transport may also
ask a receiver for memory (``region``) before it writes a bucket there.
Receiver → sender: ``begun`` (with the receiver's staging parity), ``ack`` per bucket (its buffer
slot may be reused), ``verified`` or ``failed`` after ``end``, ``committed`` or ``failed`` after
``commit``.

Both sides take the slow work off the critical path: the sender hashes bucket *k* on a worker
thread while it packs bucket *k + 1*, and a receiver whose buckets land in memory that stays
valid (``owned_buckets``) acks at once and verifies on a worker thread while the next bucket
arrives; nothing is committed before every verdict is in.

The update is all-or-nothing across receivers: ``commit`` is sent only when every receiver
verified every bucket. The sender keeps ``num_buffers`` buckets of memory; a slot is refilled
only after every receiver acknowledged the bucket it held.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from miles_transport_common.bucketing import BucketPacker, Manifest, PackedBucket
from miles_transport_common.checksum import combine_digests, tensor_digest
from miles_transport_common.deadline import Deadline
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.framing import accept, connect, expect, listen, recv_msg, send_msg
from miles_transport_common.metrics import sync_metrics
from miles_transport_common.options import TransportOptions
from miles_transport_common.served import ReadServed, TensorSums, check_reported
from miles_transport_common.staging import (
    ReceiverState,
    StagingPool,
    Target,
    UpdateStager,
    adopter_of,
    as_loader,
    reader_of,
)

log = logging.getLogger(__name__)

FaultHook = Callable[[Manifest, torch.Tensor], None]
Finish = Callable[[], list[dict[str, Any]]]


class SocketSender:
    """Sending side: listens at ``options.host:options.port`` (see :attr:`address`); receivers
    connect and say hello; :meth:`send` streams one update to all of them.

    Subclasses provide the buffers (:meth:`allocate`) and the delivery of a bucket's bytes
    (:meth:`deliver`). ``fault_hook(manifest, data)`` is a test hook called after a bucket's
    checksum is computed and before it is delivered.
    """

    transport = "socket"

    def __init__(
        self,
        options: TransportOptions,
        *,
        num_receivers: int = 1,
        num_buffers: int = 2,
        device: str = "cpu",
        fault_hook: FaultHook | None = None,
    ) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers must be at least 1, got {num_receivers}")
        self.options = options
        #: receivers (engines) that connect and take part in every update
        self.num_receivers = num_receivers
        self.fault_hook = fault_hook
        self._srv = listen(options.listen_host, options.port)
        self.address: tuple[str, int] = (options.listen_host, self._srv.getsockname()[1])
        self.conns: list[socket.socket] = []
        self.hellos: list[dict[str, Any]] = []
        #: each receiver's staging parity for the update in progress (from its ``begun``)
        self.parities: list[int] = []
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-hash")
        self.packer = BucketPacker(
            options.bucket_bytes,
            num_buffers=num_buffers,
            allocate=self.allocate,
            device=device,
            hasher=self.hasher,
            hash_inline=True,
        )
        self._acked: list[int] = []
        self._broken = False
        #: the version being sent (subclasses tag their deliveries with it)
        self.current_version = 0
        #: the checksum of every tensor of the update being sent, from the bucket manifests
        self.sums = TensorSums()

    # --- what subclasses provide -------------------------------------------------------------

    def allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        """A bucket buffer for ``slot``."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def welcome(self, index: int, hello: dict[str, Any]) -> dict[str, Any]:
        """Extra fields of the reply to receiver ``index``'s hello."""
        return {}

    #: called about every millisecond while waiting for a receiver's message (None: block)
    idle: Callable[[], None] | None = None

    def packer_for(self, version: int) -> BucketPacker:
        """The packer of this update (default: the one packer)."""
        return self.packer

    def committed(self) -> None:
        """Called after every receiver committed an update."""

    def update_done(self) -> None:
        """Called when an update ends, whether it succeeded or not."""

    def deliver(
        self, bucket: PackedBucket, deadline: Deadline
    ) -> Callable[[], list[dict[str, Any]]]:
        """Start making the bucket's bytes available to every receiver; returns ``finish``,
        which waits until they are and returns, per receiver, the extra fields of its
        ``bucket`` message. The next bucket is packed between the two calls."""
        raise NotImplementedError

    # --- protocol ----------------------------------------------------------------------------

    def _deadline(self, what: str) -> Deadline:
        return Deadline(self.options.timeout_s, f"{what} ({self.transport} transport)")

    def connect(self) -> None:
        """Wait for ``num_receivers`` receivers to connect (at most ``timeout_s``)."""
        deadline = self._deadline(f"{self.num_receivers} receiver(s) to connect")
        while len(self.conns) < self.num_receivers:
            conn = accept(self._srv, deadline)
            hello = expect(recv_msg(conn, deadline), "hello")
            index = len(self.conns)
            send_msg(
                conn, {"op": "welcome", "index": index, **self.welcome(index, hello)}, deadline
            )
            self.conns.append(conn)
            self.hellos.append(hello)
            self._acked.append(0)

    def _broadcast(self, msg: dict[str, Any], deadline: Deadline) -> None:
        for conn in self.conns:
            send_msg(conn, msg, deadline)

    def _read(self, index: int, deadline: Deadline) -> dict[str, Any]:
        msg = recv_msg(self.conns[index], deadline, self.idle)
        if msg.get("op") == "ack":
            self._acked[index] = int(msg["seq"]) + 1
        elif msg.get("op") == "failed":
            raise BucketRejected(f"receiver {index} rejected the update: {msg.get('reason')}")
        return msg

    def _wait_acks(self, upto: int, deadline: Deadline) -> None:
        for i in range(len(self.conns)):
            while self._acked[i] < upto:
                self._read(i, deadline)

    def _wait_for(self, op: str, deadline: Deadline) -> list[dict[str, Any]]:
        out = []
        for i in range(len(self.conns)):
            while True:
                msg = self._read(i, deadline)
                if msg.get("op") == op:
                    out.append(msg)
                    break
                if msg.get("op") != "ack":
                    raise TransportError(f"protocol error: receiver {i} sent {msg.get('op')!r}")
        return out

    def receiver_name(self, index: int) -> str:
        """How errors name receiver ``index``: the engine its hello named, else its index."""
        return str(self.hellos[index].get("engine") or f"receiver {index}")

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> dict[str, float]:
        """Stream ``weights`` to every receiver and make them commit ``version``; returns timing
        metrics. Raises :class:`TransportError` (:class:`TransportTimeout`,
        :class:`BucketRejected`) when any receiver rejects, dies or stalls: then none commits."""
        if self._broken:
            raise TransportError(
                f"{self.transport} transport: a receiver connection broke earlier; build a new "
                "sender"
            )
        self.connect()
        self.current_version = version
        t0 = time.perf_counter()
        self._acked = [0] * len(self.conns)  # every bucket of the last update was acked
        self.sums = TensorSums()
        try:
            self._begin(version)
            nbuckets, nbytes, whash = self._stream(weights, version)
            t_sent = self._conclude(version, nbuckets, whash)
            self.committed()
        except BucketRejected as exc:
            try:
                self._broadcast({"op": "abort", "reason": str(exc)}, self._deadline("abort"))
                self._drain_aborted()
            except TransportError:
                self._broken = True
            raise TransportError(
                f"{self.transport} transport: update {version} rejected, no receiver committed "
                f"it: {exc}"
            ) from exc
        except TransportError:
            self._broken = True
            raise
        finally:
            self.update_done()
        return sync_metrics(t0, t_sent, time.perf_counter(), nbytes, nbuckets)

    def _begin(self, version: int) -> None:
        """Announce the update and learn each receiver's staging parity."""
        self._broadcast({"op": "begin", "version": version}, self._deadline("begin"))
        begun = self._deadline("receivers to begin")
        self.parities = [
            int(expect(self._read(i, begun), "begun").get("parity", 0))
            for i in range(len(self.conns))
        ]

    def _stream(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, str | None]:
        """Deliver and announce every bucket of ``weights``; returns the bucket count, their
        bytes and the weights hash (when verified)."""
        opts = self.options
        slot_seq: dict[int, int] = {}
        digests: dict[str, bytes] = {}
        nbuckets = nbytes = 0

        def before_fill(slot: int) -> None:
            if slot in slot_seq:
                self._wait_acks(
                    slot_seq[slot] + 1, self._deadline(f"receivers to free slot {slot}")
                )

        def on_tensor(name: str, t: torch.Tensor) -> None:
            digests[name] = tensor_digest(name, t)

        pending: tuple[PackedBucket, Deadline, Finish] | None = None
        for bucket in self.packer_for(version).pack(
            weights,
            before_fill=before_fill,
            on_tensor=on_tensor if opts.verify_weights_hash else None,
        ):
            if self.fault_hook is not None:
                # the bytes as they will leave: the packed buffer, or (zero copy) the
                # largest source piece
                data = max(bucket.sources, key=torch.numel) if bucket.sources else bucket.data
                self.fault_hook(bucket.ready().manifest, data)
            deadline = self._deadline(f"bucket {bucket.manifest.seq}")
            finish = self.deliver(bucket, deadline)
            slot_seq[bucket.slot] = bucket.manifest.seq
            nbuckets += 1
            nbytes += bucket.manifest.nbytes
            # The previous bucket's delivery ran while this one was packed; announce it now.
            if pending is not None:
                self._announce(*pending)
            pending = (bucket, deadline, finish)
        if pending is not None:
            self._announce(*pending)
        whash = combine_digests(digests) if opts.verify_weights_hash else None
        return nbuckets, nbytes, whash

    def _announce(self, bucket: PackedBucket, deadline: Deadline, finish: Finish) -> None:
        """Wait for the bucket's delivery, then tell every receiver where it is."""
        extras = finish()
        bucket.ready()
        self.sums.add_manifest(bucket.manifest)
        head = {"op": "bucket", "slot": bucket.slot, **bucket.manifest.to_json()}
        for conn, extra in zip(self.conns, extras, strict=True):
            send_msg(conn, {**head, **extra}, deadline)

    def _conclude(self, version: int, nbuckets: int, whash: str | None) -> float:
        """End the update, wait for every verdict, then commit; returns when every bucket was
        verified (a ``time.perf_counter`` reading)."""
        end = {"op": "end", "buckets": nbuckets, "weights_hash": whash}
        self._broadcast(end, self._deadline("end"))
        self._wait_for("verified", self._deadline("receivers to verify the update"))
        t_sent = time.perf_counter()
        self._broadcast({"op": "commit"}, self._deadline("commit"))
        try:
            answers = self._wait_for("committed", self._deadline("receivers to load the update"))
            for i, answer in enumerate(answers):
                check_reported(self.receiver_name(i), answer, self.sums, version)
        except BucketRejected as exc:
            # Others may have committed already: the receivers now disagree on the version.
            raise TransportError(
                f"{self.transport} transport: a receiver failed to load update {version} "
                f"({exc}); receivers may now hold different versions"
            ) from exc
        return t_sent

    def _drain_aborted(self) -> None:
        # Every receiver answers an abort with "aborted"; read up to it so the next update
        # starts on a clean stream.
        deadline = self._deadline("receivers to abort")
        for i, conn in enumerate(self.conns):
            while recv_msg(conn, deadline).get("op") != "aborted":
                pass
            self._acked[i] = 0

    def close(self) -> None:
        """Close the connections and the listening socket."""
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self._srv.close()
        self.hasher.shutdown(wait=True)


class SocketReceiver:
    """Receiving side: connects to a :class:`SocketSender` at ``address`` on the first
    :meth:`receive` (or :meth:`connect`); each :meth:`receive` takes part in one update.

    Subclasses say how a bucket's bytes are reached (:meth:`bucket_data`) and what the hello
    carries (:meth:`hello`).
    """

    transport = "socket"
    #: bucket buffers stay untouched until the update after next: whole tensors are staged as
    #: views of them (no copy) and verified on the worker thread after the ack
    owned_buckets = False

    def __init__(
        self,
        options: TransportOptions,
        address: tuple[str, int],
        *,
        version: int = 0,
        device: str = "cpu",
    ) -> None:
        self.options = options
        self.address = address
        self.device = device
        self.state = ReceiverState(version=version)
        self.pool = StagingPool(device, on_new=self.on_new_buffer)
        self.verifier = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-verify")
        self.stager: UpdateStager | None = None
        self.conn: socket.socket | None = None
        self.welcome: dict[str, Any] = {}
        #: the version being received (subclasses match deliveries with it)
        self.current_version = version
        self.last_error: str | None = None

    @property
    def version(self) -> int:
        """The weight version the target holds."""
        return self.state.version

    def hello(self) -> dict[str, Any]:
        """Extra fields of the hello message."""
        return {}

    #: called about every millisecond while waiting for the sender's message (None: block)
    idle: Callable[[], None] | None = None

    def bucket_data(self, msg: dict[str, Any], manifest: Manifest) -> torch.Tensor:
        """The bytes of the bucket announced by ``msg``."""
        raise NotImplementedError

    def on_new_buffer(self, buf: torch.Tensor) -> None:
        """Called for each staging buffer the pool allocates (to register it)."""

    def region(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer to the sender's ``region`` request (memory to write a bucket into)."""
        raise TransportError(f"the {self.transport} transport does not ask for regions")

    def _deadline(self, what: str) -> Deadline:
        return Deadline(self.options.timeout_s, f"{what} ({self.transport} transport)")

    def connect(self) -> None:
        """Connect to the sender and exchange hellos (at most ``timeout_s``)."""
        if self.conn is None:
            deadline = self._deadline("the sender to accept")
            conn = connect(*self.address, deadline)
            send_msg(conn, {"op": "hello", **self.hello()}, deadline)
            self.welcome = expect(recv_msg(conn, deadline), "welcome")
            self.conn = conn

    def receive(self, target: Target, read_served: ReadServed | None = None) -> int:
        """Take part in one update; returns the new version.

        Raises :class:`BucketRejected` when this or another receiver rejected the update, or
        :class:`TransportError` when the sender died or stalled; ``target`` and the version are
        then left as they were (in ``staging="full"``). ``read_served`` (default: the target's
        own, see :func:`~.staging.reader_of`): the commit checks that the target then serves
        what was sent (:mod:`.served`), and a mismatch fails it naming the tensor.
        """
        self.connect()
        assert self.conn is not None
        conn, opts = self.conn, self.options
        self.last_timings: dict[str, float] = {}
        stager = self.stager = UpdateStager(
            as_loader(target),
            self.state,
            mode=opts.staging,
            device=self.device,
            hash_weights=opts.verify_weights_hash,
            pool=self.pool,
            adopt=adopter_of(target),
            verifier=self.verifier,
            read_served=(read_served or reader_of(target)) if opts.verify_served else None,
        )
        begin = expect(recv_msg(conn, self._deadline("an update to begin"), self.idle), "begin")
        stager.begin(int(begin["version"]))
        self.current_version = int(begin["version"])
        send_msg(conn, {"op": "begun", "parity": stager.parity}, self._deadline("begun"))
        try:
            while True:
                msg = recv_msg(conn, self._deadline("the next bucket"), self.idle)
                if msg["op"] == "abort":
                    raise BucketRejected(f"the sender aborted the update: {msg.get('reason')}")
                if msg["op"] == "end":
                    break
                if msg["op"] == "region":
                    send_msg(conn, self.region(msg), self._deadline("region"))
                    continue
                manifest = Manifest.from_json(expect(msg, "bucket"))
                data = self.bucket_data(msg, manifest)
                stager.add_bucket(manifest, data, owned=self.owned_buckets)
                send_msg(conn, {"op": "ack", "seq": manifest.seq}, self._deadline("ack"))
            stager.finish(int(msg["buckets"]), msg.get("weights_hash"))
            send_msg(conn, {"op": "verified"}, self._deadline("verified"))
            decision = recv_msg(conn, self._deadline("the commit decision"), self.idle)
            if decision["op"] == "abort":
                raise BucketRejected(f"the sender aborted the update: {decision.get('reason')}")
            expect(decision, "commit")
            try:
                version = stager.commit()
            except Exception as exc:
                send_msg(conn, {"op": "failed", "reason": f"load: {exc}"}, self._deadline("failed"))
                raise TransportError(f"loading update {stager.version} failed: {exc}") from exc
            committed = {"op": "committed", "version": version}
            if stager.served_checksum is not None:
                committed["weights_checksum"] = stager.served_checksum
            send_msg(conn, committed, self._deadline("committed"))
        except BucketRejected as exc:
            stager.abort()
            self.last_error = str(exc)
            log.error("%s", exc)
            if "aborted" not in str(exc):
                send_msg(conn, {"op": "failed", "reason": str(exc)}, self._deadline("failed"))
                # the sender answers with an abort; skip what it sent before seeing our failure
                while recv_msg(conn, self._deadline("the abort")).get("op") != "abort":
                    pass
            send_msg(conn, {"op": "aborted"}, self._deadline("aborted"))
            raise
        except TransportError:
            stager.abort()
            raise
        self.last_error = None
        self.last_timings = dict(stager.timings)
        return version

    def close(self) -> None:
        """Close the connection."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.pool.clear()
        self.verifier.shutdown(wait=True)
