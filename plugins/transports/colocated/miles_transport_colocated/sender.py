"""The trainer side of the colocated transport: SGLang's ``POST /update_weights_from_tensor``
with buckets handed over by handle (shared memory on CPU, CUDA IPC on GPU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from miles_transport_common import http
from miles_transport_common.bucketing import BucketPacker, Manifest, PackedBucket
from miles_transport_common.checksum import combine_digests, tensor_digest
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.metrics import sync_metrics
from miles_transport_common.payload import (
    bucket_payload,
    control_payload,
    serialize,
    shared_cpu_buffer,
)
from miles_transport_common.served import TensorSums, check_reported

from miles_core.contracts import AdapterSync
from miles_transport_colocated.adapter import pack_adapter, publish_adapter
from miles_transport_colocated.config import ColocatedOptions

FaultHook = Callable[[Manifest, torch.Tensor], None]
ENDPOINT = "/update_weights_from_tensor"


class ColocatedSender:
    """Packs the weights into shared bucket buffers and has every engine load them through
    ``POST /update_weights_from_tensor`` (``load_format="flattened_bucket"``), one call per
    bucket, then an *end* and a *commit* call (see :mod:`miles_transport_common.engine_side`).

    Each item carries the bucket as a tensor whose storage is shared: the engine maps it (torch's
    reductions, as SGLang's serializer produces), nothing is copied through the HTTP body. The
    next bucket is packed while the engines take the last one.

    ``memory="model"``: two sets of buffers, one bucket each, used by successive updates in
    turn; an engine that can adopt serves straight from the set of the last committed update,
    so the next update is packed into the other set, and the live set changes only when every
    engine committed. ``memory="bucket"``: ``num_buffers`` buffers reused within an update; a
    buffer is refilled once every engine answered the call that carried it (the engine copies
    the bucket out before it answers).

    A tensor larger than a bucket travels whole in a bucket of its own size (SGLang loads whole
    tensors). ``fault_hook(manifest, data)``, a test hook, is called after a bucket's checksum is
    computed and before the engines read it.
    """

    def __init__(self, options: ColocatedOptions, *, fault_hook: FaultHook | None = None) -> None:
        self.options = options
        self.fault_hook = fault_hook
        self.device = options.device
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="miles-bucket-hash")
        self.fanout = http.Fanout()
        self.live_set = 1  # the first update packs into set 0
        if options.memory == "model":
            self.sets = [self._packer(None) for _ in (0, 1)]
        self.packer = self._packer(options.num_buffers)
        #: the engines of the last update and each one's tensor-parallel size
        self.engines: tuple[str, ...] = ()
        self.tp: dict[str, int] = {}
        #: the checksum of every tensor of the update being sent (from its bucket manifests)
        self.sums = TensorSums()
        self._closed = False

    def _packer(self, num_buffers: int | None) -> BucketPacker:
        return BucketPacker(
            self.options.bucket_bytes,
            num_buffers=num_buffers,
            allocate=self._allocate,
            hasher=self.hasher,
            hash_inline=True,
            split=False,
        )

    def _allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        if self.device == "cpu":
            return shared_cpu_buffer(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _items(self, url: str, payload: dict[str, Any]) -> list[Any]:
        # One item per rank, each pickled on its own: pickling a shared storage takes one
        # reference that exactly one unpickling gives back.
        return [serialize(payload) for _ in range(self.tp.get(url, 1))]

    def _call(self, url: str, payload: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = {
            "serialized_named_tensors": self._items(url, payload),
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "abort_all_requests": False,
            **fields,
        }
        return http.call(url, ENDPOINT, body, timeout_s=self.options.timeout_s)

    def _engines(self, engines: Sequence[str]) -> list[str]:
        urls = http.engine_urls(engines, "colocated")
        if tuple(urls) != self.engines:
            # A new set of engines (one restarted): learn each one's tensor-parallel size, since
            # SGLang takes one serialized item per rank.
            self.tp = http.tensor_parallel_sizes(self.fanout, urls, self.options.timeout_s)
            self.engines = tuple(urls)
        return urls

    def send(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` to every engine at ``engines`` and have each commit ``version``;
        returns timing metrics. Raises :class:`TransportError` (``TransportTimeout``,
        ``BucketRejected``) when an engine rejects, dies or stalls: then no engine committed.
        With ``adapter``: see :meth:`_send_adapter`."""
        if self._closed:
            raise TransportError("colocated transport: the sender is closed")
        urls = self._engines(engines)
        if adapter is not None:
            return self._send_adapter(weights, adapter, version, urls)
        t0 = time.perf_counter()
        self.sums = TensorSums()
        try:
            nbuckets, nbytes, whash = self._stream(weights, version, urls)
            end = control_payload(
                {"op": "end", "version": version, "buckets": nbuckets, "weights_hash": whash}
            )
            self.fanout.run([lambda u=u: self._call(u, end) for u in urls])
            t_sent = time.perf_counter()
        except TransportError as exc:
            self._abort(version, urls)
            what = "rejected" if isinstance(exc, BucketRejected) else "failed"
            raise TransportError(
                f"colocated transport: update {version} {what}, no engine committed it: {exc}"
            ) from exc
        self._commit(version, urls)
        return sync_metrics(t0, t_sent, time.perf_counter(), nbytes, nbuckets)

    def _stream(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str]
    ) -> tuple[int, int, str | None]:
        """Hand every bucket of ``weights`` to the engines, one call each, in order; returns
        the bucket count, their bytes and the weights hash (when verified). On a failure,
        waits for the calls still reading a buffer before raising."""
        opts = self.options
        model = opts.memory == "model"
        packer = self.sets[1 - self.live_set] if model else self.packer
        digests: dict[str, bytes] = {}
        in_flight: dict[int, Callable[[], list[dict[str, Any]]]] = {}
        last: Callable[[], list[dict[str, Any]]] | None = None
        nbuckets = nbytes = 0

        def before_fill(slot: int) -> None:
            wait = in_flight.pop(slot, None)
            if wait is not None:
                wait()

        def on_tensor(name: str, t: torch.Tensor) -> None:
            digests[name] = tensor_digest(name, t)

        try:
            for bucket in packer.pack(
                weights,
                before_fill=None if model else before_fill,
                on_tensor=on_tensor if opts.verify_weights_hash else None,
            ):
                payload = self._bucket_payload(bucket, version, model)
                if last is not None:
                    last()  # an engine takes the buckets of an update in order, one at a time
                last = self.fanout.start([lambda u=u, p=payload: self._call(u, p) for u in urls])
                in_flight[bucket.slot] = last
                nbuckets += 1
                nbytes += bucket.manifest.nbytes
            if last is not None:
                last()
            in_flight.clear()
        except TransportError:
            for wait in in_flight.values():
                try:
                    wait()
                except TransportError:
                    pass
            raise
        whash = combine_digests(digests) if opts.verify_weights_hash else None
        return nbuckets, nbytes, whash

    def _bucket_payload(self, bucket: PackedBucket, version: int, owned: bool) -> dict[str, Any]:
        """The payload of one bucket, once its checksum is in and its bytes are visible."""
        opts = self.options
        bucket.ready()
        self.sums.add_manifest(bucket.manifest)
        if self.fault_hook is not None:
            self.fault_hook(bucket.manifest, bucket.data)
        if self.device != "cpu":
            torch.cuda.current_stream().synchronize()  # the packing must be visible
        header = {
            "op": "bucket",
            "version": version,
            "manifest": bucket.manifest.to_json(),
            "owned": owned,
            "staging": opts.staging,
            "weights_hash": opts.verify_weights_hash,
            "verify_served": opts.verify_served,
        }
        return bucket_payload(bucket.data, bucket.manifest, header)

    def _commit(self, version: int, urls: list[str]) -> None:
        """Have every engine commit ``version`` and check what each then serves (an engine
        that checks answers its ``weights_checksum``, see ``miles_transport_common.served``);
        in ``memory="model"`` the set just sent becomes the live one."""
        model = self.options.memory == "model"
        payload = control_payload({"op": "commit", "version": version})
        try:
            answers = self.fanout.run(
                [
                    lambda u=u: self._call(
                        u, payload, weight_version=str(version), flush_cache=True
                    )
                    for u in urls
                ]
            )
            for url, answer in zip(urls, answers, strict=True):
                check_reported(url, answer, self.sums, version)
        except TransportError as exc:
            if model:
                # Some engines may serve from the set just sent, others from the old one: never
                # write into either again (the engines keep their mappings alive).
                self.sets = [self._packer(None) for _ in (0, 1)]
            raise TransportError(
                f"colocated transport: an engine failed to commit update {version} ({exc}); "
                "the engines may now hold different versions"
            ) from exc
        if model:
            self.live_set = 1 - self.live_set

    def _send_adapter(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        adapter: AdapterSync,
        version: int,
        urls: list[str],
    ) -> dict[str, float]:
        """An adapter through SGLang's LoRA API: the whole adapter packed into one shared
        bucket (an adapter is small), then on every engine ``/load_lora_adapter_from_tensors``
        with that bucket as its one ``flattened_bucket`` item (by handle, as the model's
        buckets go), and ``/update_weight_version``. The bucket's Miles header (which SGLang
        ignores) carries its checksum: the embedded engine verifies it and replaces the adapter
        of that name in one step. An engine that refuses a name it already serves (SGLang)
        gets ``/unload_lora_adapter`` and the load again."""
        t0 = time.perf_counter()
        named = [(n, t.detach()) for n, t in weights]
        packer, bucket = pack_adapter(named, adapter, allocate=self._allocate, hasher=self.hasher)
        if self.fault_hook is not None:
            self.fault_hook(bucket.manifest, bucket.data)
        if self.device != "cpu":
            torch.cuda.current_stream().synchronize()
        header = {"op": "adapter", "version": version, "manifest": bucket.manifest.to_json()}
        payload = bucket_payload(bucket.data, bucket.manifest, header)
        timeout_s = self.options.timeout_s

        def items(url: str) -> list[Any]:
            return self._items(url, payload)

        try:
            self.fanout.run(
                [lambda u=u: publish_adapter(u, adapter, version, items, timeout_s) for u in urls]
            )
        except TransportError as exc:
            raise TransportError(
                f"colocated transport: adapter {adapter.name!r} update {version} failed: {exc}"
            ) from exc
        finally:
            packer.buffers.clear()
        t1 = time.perf_counter()
        return sync_metrics(t0, t1, t1, bucket.manifest.nbytes, 1)

    def _abort(self, version: int, urls: list[str]) -> None:
        """Tell every engine still answering to drop the staged update (best effort: an engine
        that does not hear it drops it when the next update begins)."""
        payload = control_payload({"op": "abort", "version": version})
        calls = [lambda u=u: self._call(u, payload) for u in urls]
        try:
            self.fanout.run(calls)
        except TransportError:
            pass

    def close(self) -> None:
        """Free the shared buffers and the worker threads (idempotent). Engines that serve from
        a buffer keep their own mapping of it."""
        if self._closed:
            return
        self._closed = True
        self.packer.buffers.clear()
        for packer in getattr(self, "sets", []):
            packer.buffers.clear()
        self.fanout.close()
        self.hasher.shutdown(wait=True)


def build(options: ColocatedOptions) -> ColocatedSender:
    """Factory of the registered ``colocated`` transport: the sending side."""
    return ColocatedSender(options)
