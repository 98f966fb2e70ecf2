"""The trainer side of the broadcast transport: rank 0 of a weight-update group that the engines
join through SGLang's ``POST /init_weights_update_group``, fed bucket by bucket through
``POST /update_weights_from_distributed``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from miles_transport_common import http
from miles_transport_common.bucketing import BucketPacker, Manifest
from miles_transport_common.errors import BucketRejected, TransportError, TransportTimeout
from miles_transport_common.groups import join_update_group, leave_update_group, master_store
from miles_transport_common.metrics import sync_metrics
from miles_transport_common.served import TensorSums, check_reported, first_difference

from miles_core.contracts import AdapterSync
from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.group import bcast

FaultHook = Callable[[Manifest, torch.Tensor], None]
ENDPOINT = "/update_weights_from_distributed"
#: the same protocol into a LoRA adapter (Miles's extension, ``lora_weight_updates``)
LORA_ENDPOINT = "/miles/update_lora_from_distributed"


@dataclass
class _UpdateCalls:
    """The calls of one update to every engine of the group: the endpoint (the model's, or the
    LoRA extension's) and the body SGLang's ``/update_weights_from_distributed`` expects."""

    urls: list[str]
    group: str
    endpoint: str = ENDPOINT
    lora: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, urls: list[str], group: str, adapter: AdapterSync | None) -> _UpdateCalls:
        """The calls of an update of the model, or of ``adapter`` when one is given."""
        if adapter is None:
            return cls(urls, group)
        lora = {"lora_name": adapter.name, "config_dict": dict(adapter.config)}
        return cls(urls, group, LORA_ENDPOINT, lora)

    def body(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], **extra: Any
    ) -> dict[str, Any]:
        """One call's body: the tensors of a bucket (none for the *end* and *commit* calls)."""
        return {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.group,
            "flush_cache": False,
            "abort_all_requests": False,
            **self.lora,
            **extra,
        }


class BroadcastSender:
    """Rank 0 of the update group: streams named tensors to every engine.

    The group is formed on the first :meth:`send` and again whenever the set of engines differs
    from the last one or the group broke: the sender hosts the TCP store at
    ``options.host:options.port`` (0: a free port) and asks each engine to join through
    ``/init_weights_update_group`` (engine ``i`` takes ranks from ``rank_offset``, one per
    tensor-parallel rank). Each group has a fresh name, so an engine never mixes two.

    Per bucket (packed back to back, SGLang's ``flattened_bucket`` layout; a tensor larger than a
    bucket travels whole, alone): one ``/update_weights_from_distributed`` call per engine with
    the bucket's names, dtypes and shapes, while the bucket is broadcast. Then an *end* call
    (no tensors, no version): an engine that verifies (the embedded one) answers the checksum of
    every bucket it staged, which must equal the sender's; then a *commit* call with the
    version. A mismatch, a refused call or a dead engine makes :meth:`send` raise before any
    commit; the group is then formed anew on the next send, which drops whatever the engines
    staged. ``fault_hook(manifest, data)`` is a test hook called after a bucket's checksum is
    computed and before it is sent (``data`` of a tensor larger than a bucket is that tensor's
    own memory: it travels without a copy).
    """

    def __init__(self, options: BroadcastOptions, *, fault_hook: FaultHook | None = None) -> None:
        self.options = options
        self.fault_hook = fault_hook
        self.device = "cuda" if options.backend == "nccl" else "cpu"
        self.packer = BucketPacker(
            options.bucket_bytes,
            num_buffers=options.num_buffers,
            device=self.device,
            hash_inline=True,
            align=1,
            split=False,
            alone_in_place=True,  # the gloo/NCCL group reads any memory
        )
        self.fanout = http.Fanout()
        self.engines: tuple[str, ...] = ()
        self.tp: dict[str, int] = {}
        self.group_name = ""
        self._pg: Any = None
        self._store: Any = None
        self._closed = False
        #: how many times a group was formed (a test and a metric read it)
        self.groups_formed = 0

    @property
    def address(self) -> tuple[str, int]:
        """Where the group's store listens (valid while a group is formed)."""
        return (self.options.listen_host, int(self._store.port) if self._store is not None else 0)

    def _call(self, url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return http.call(url, endpoint, body, timeout_s=self.options.timeout_s)

    def _drop_group(self) -> None:
        if self._pg is not None:
            leave_update_group(self._pg)
        self._pg = None
        self._store = None
        self.engines = ()

    def _form(self, urls: list[str]) -> None:
        """Form a new group with the engines at ``urls`` (rank 0 here)."""
        opts = self.options
        self._drop_group()
        self.tp = http.tensor_parallel_sizes(self.fanout, urls, opts.timeout_s)
        world = 1 + sum(self.tp.values())
        self._store = store = master_store(opts.listen_host, opts.port, world, opts.timeout_s)
        self.group_name = f"miles-broadcast-{uuid.uuid4().hex[:12]}"
        offsets, rank = [], 1
        for u in urls:
            offsets.append(rank)
            rank += self.tp[u]
        joins = self.fanout.start(
            [
                lambda u=u, off=off: self._call(
                    u,
                    "/init_weights_update_group",
                    {
                        "master_address": opts.listen_host,
                        "master_port": int(store.port),
                        "rank_offset": off,
                        "world_size": world,
                        "group_name": self.group_name,
                        "backend": opts.backend,
                    },
                )
                for u, off in zip(urls, offsets, strict=True)
            ]
        )
        try:
            pg = join_update_group(
                master_address=opts.listen_host,
                master_port=int(store.port),
                rank=0,
                world_size=world,
                group_name=self.group_name,
                backend=opts.backend,
                timeout_s=opts.timeout_s,
                store=store,
            )
        except Exception as exc:
            try:
                joins()
            except TransportError as failed:
                raise TransportError(
                    f"broadcast transport: an engine could not join the group: {failed}"
                ) from exc
            raise TransportTimeout(
                f"broadcast transport: forming the group failed ({exc}); an engine is missing, "
                "dead or too slow"
            ) from exc
        joins()
        self._pg = pg
        self.engines = tuple(urls)
        self.groups_formed += 1

    def send(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` to every engine at ``engines`` and have each commit ``version``.

        With ``adapter`` the calls go to ``/miles/update_lora_from_distributed`` (Miles's
        extension, the ``lora_weight_updates`` engine capability: SGLang's body plus
        ``lora_name`` and ``config_dict``): the tensors are the adapter's, staged like a
        model's, and the commit replaces the engine's adapter of that name instead of model
        weights.

        Returns timing metrics. Raises :class:`TransportError` (or :class:`TransportTimeout`)
        if any engine refused a bucket, answered a different checksum, died or stalled; then no
        engine committed (all or none), except an engine whose own load failed at commit."""
        if self._closed:
            raise TransportError("broadcast transport: the sender is closed")
        urls = http.engine_urls(engines, "broadcast")
        t0 = time.perf_counter()
        if tuple(urls) != self.engines or self._pg is None:
            self._form(urls)
        calls = _UpdateCalls.of(urls, self.group_name, adapter)
        try:
            sent, nbytes = self._stream(weights, calls)
            self._verify(calls, sent)
            t_sent = time.perf_counter()
            sums = TensorSums()
            for manifest in sent:
                sums.add_manifest(manifest)
        except Exception as exc:
            # The engines may hold part of the update staged, or the group may be broken:
            # a new group (formed on the next send) drops everything staged.
            self._drop_group()
            raise _failure(exc, version) from exc
        try:
            self._commit(calls, version, sums)
        except TransportError as exc:
            self._drop_group()
            raise TransportError(
                f"broadcast transport: an engine failed to commit update {version} ({exc}); the "
                "engines may now hold different versions"
            ) from exc
        return sync_metrics(t0, t_sent, time.perf_counter(), nbytes, len(sent))

    def _stream(
        self, weights: Iterable[tuple[str, torch.Tensor]], calls: _UpdateCalls
    ) -> tuple[list[Manifest], int]:
        """Broadcast the buckets of ``weights``, each announced by one call per engine; returns
        the manifest of every bucket sent (with its checksums) and their bytes."""
        pg = self._pg
        pending: dict[int, Any] = {}
        sent: list[Manifest] = []
        last: Callable[[], list[dict[str, Any]]] | None = None
        nbytes = 0

        def before_fill(slot: int) -> None:
            work = pending.pop(slot, None)
            if work is not None:
                work.wait()

        for bucket in self.packer.pack(weights, before_fill=before_fill):
            bucket.ready()
            if self.fault_hook is not None:
                self.fault_hook(bucket.manifest, bucket.data)
            if self.device == "cuda":
                torch.cuda.current_stream().synchronize()
            pieces = bucket.manifest.pieces
            req = calls.body(
                [p.name for p in pieces],
                [p.dtype for p in pieces],
                [list(p.shape) for p in pieces],
                load_format="flattened_bucket",
            )
            if last is not None:
                last()  # the engines take the buckets in order
            last = self.fanout.start(
                [lambda u=u, r=req: self._call(u, calls.endpoint, r) for u in calls.urls]
            )
            try:
                pending[bucket.slot] = bcast(pg, bucket.data)
            except Exception as exc:
                raise TransportError(
                    f"broadcast of bucket {bucket.manifest.seq} failed: {exc}"
                ) from exc
            sent.append(bucket.manifest)
            nbytes += bucket.manifest.nbytes
        for work in pending.values():
            work.wait()
        pending.clear()
        if last is not None:
            last()
        return sent, nbytes

    def _verify(self, calls: _UpdateCalls, sent: list[Manifest]) -> None:
        """The *end* call: an engine that verifies answers the checksum of every bucket it
        staged, which must be the ones ``sent``, and of every piece (``sums``), which name the
        tensor that differs."""
        answers = self.fanout.run(
            [lambda u=u: self._call(u, calls.endpoint, calls.body([], [], [])) for u in calls.urls]
        )
        checksums = [m.checksum for m in sent]
        for u, answer in zip(calls.urls, answers, strict=True):
            got = answer.get("checksums")
            if got is None or list(got) == checksums:
                continue
            for manifest, sums in zip(sent, answer.get("sums") or [], strict=False):
                why = first_difference(u, manifest.pieces, manifest.sums, sums)
                if why is not None:
                    raise BucketRejected(f"bucket {manifest.seq}: {why}")
            bad = [i for i, (a, b) in enumerate(zip(got, checksums, strict=False)) if a != b]
            raise BucketRejected(
                f"engine {u} received bucket(s) {bad or 'count ' + str(len(got))} with a "
                "different checksum than sent"
            )

    def _commit(self, calls: _UpdateCalls, version: int, sums: TensorSums) -> None:
        """The *commit* call: every engine loads what it staged as ``version``; an engine that
        checks what it then serves answers its ``weights_checksum``, which must be ``sums``'."""
        body = calls.body([], [], [], weight_version=str(version), flush_cache=True)
        answers = self.fanout.run(
            [lambda u=u: self._call(u, calls.endpoint, body) for u in calls.urls]
        )
        for url, answer in zip(calls.urls, answers, strict=True):
            check_reported(url, answer, sums, version)

    def close(self) -> None:
        """Leave the group, free the buffers and the worker threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._drop_group()
        self.packer.buffers.clear()
        self.fanout.close()


def _failure(exc: Exception, version: int) -> TransportError:
    """The error of an update that failed before any engine committed it."""
    if isinstance(exc, TransportError):
        what = "rejected" if isinstance(exc, BucketRejected) else "failed"
        return TransportError(
            f"broadcast transport: update {version} {what}, no engine committed it: {exc}"
        )
    return TransportError(
        f"broadcast transport: update {version} failed ({type(exc).__name__}: {exc}); "
        "an engine probably died"
    )


def build(options: BroadcastOptions) -> BroadcastSender:
    """Factory of the registered ``broadcast`` transport: the sending side."""
    return BroadcastSender(options)
