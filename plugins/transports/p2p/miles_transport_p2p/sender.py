"""The trainer side of the p2p transport."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from miles_transport_common.bucketing import BucketPacker, PackedBucket
from miles_transport_common.deadline import Deadline
from miles_transport_common.errors import TransportError
from miles_transport_common.framing import send_msg
from miles_transport_common.session import FaultHook, Finish, SocketSender

from miles_core.contracts import AdapterSync
from miles_transport_p2p.agent import b64, mem_type, new_agent, region, unb64
from miles_transport_p2p.config import RECEIVER_ROUTE, P2POptions


class P2PSender(SocketSender):
    """Writes each bucket into a region the receiver registered for it (one NIXL WRITE per
    receiver, with a notification the receiver waits for before reading the region). A
    receiver's regions are asked for once (``region`` messages) and remembered, per staging
    parity in full staging.

    ``zero_copy=True`` (default): nothing is packed. The bucket's pieces are registered where
    they lie (in the trainer's tensors) for the duration of the write, and one WRITE with a
    descriptor per piece puts each at its offset in the receiver's region; the checksum is
    computed over the same source bytes on the hasher thread meanwhile. ``zero_copy=False``:
    buckets are packed into ``num_buffers`` registered buffers first (for memory NIXL cannot
    register)."""

    transport = "p2p"

    def __init__(
        self,
        options: P2POptions,
        *,
        num_receivers: int = 1,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.agent = new_agent("sender", options.nixl_backend)
        self._regs: list[Any] = []
        self.remotes: list[str] = []
        #: per receiver: region key -> (address, length, device id) of its registered memory
        self.regions: list[dict[tuple[int, int], tuple[int, int, int]]] = []
        self.remote_mem: list[str] = []
        self._inflight: dict[int, tuple[list[Any], int]] = {}
        self._source_regs: dict[int, torch.Tensor] = {}
        self._update_regs: list[Any] = []
        self.version = 0
        super().__init__(
            options,
            num_receivers=num_receivers,
            num_buffers=options.num_buffers,
            device=options.device,
            fault_hook=fault_hook,
        )
        self.zero_copy = options.zero_copy
        self.layout = BucketPacker(options.bucket_bytes, hasher=self.hasher, zero_copy=True)
        self.idle = self._progress  # the agent has no progress thread: progress while waiting

    def _progress(self) -> None:
        self.agent.get_new_notifs()  # drives the UCX worker; the sender expects no notifications

    def packer_for(self, version: int) -> BucketPacker:
        """The zero-copy layout, or the packing buffers."""
        return self.layout if self.zero_copy else self.packer

    def allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        """A bucket buffer registered with NIXL."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.options.device)  # type: ignore[attr-defined]
        self._regs.append(self.agent.register_memory(buf))
        return buf

    def welcome(self, index: int, hello: dict[str, Any]) -> dict[str, Any]:
        """Load the receiver's agent metadata; reply with ours."""
        self.remotes.append(self.agent.add_remote_agent(unb64(hello["agent_md"])))
        self.regions.append({})
        self.remote_mem.append("DRAM")
        return {"agent_md": b64(self.agent.get_agent_metadata())}

    def remote_region(self, i: int, seq: int, n: int, deadline: Deadline) -> tuple[int, int, int]:
        """Receiver ``i``'s registered region for bucket ``seq`` of ``n`` bytes (asked once)."""
        opts: P2POptions = self.options  # type: ignore[assignment]
        if self.hellos[i].get("staging", opts.staging) == "full":
            key = (self.parities[i], seq)
        else:  # the receiver's regions are used in turn: wait until it is done with the last
            key = (0, seq % opts.num_buffers)  # bucket written into this one
            while self._acked[i] < seq - opts.num_buffers + 1:
                self._read(i, deadline)
        got = self.regions[i].get(key)
        if got is None or got[1] < n:
            send_msg(self.conns[i], {"op": "region", "seq": seq, "nbytes": n}, deadline)
            while (msg := self._read(i, deadline)).get("op") != "region":
                if msg.get("op") != "ack":
                    raise TransportError(f"p2p: receiver {i} sent {msg.get('op')!r}, not a region")
            if "agent_md" in msg:  # the receiver registered new memory: reload its description
                # (reloading invalidates writes in flight to that agent: let them land first)
                for handles, wseq in list(self._inflight.values()):
                    self._wait_done(handles, wseq, deadline)
                self.remotes[i] = self.agent.add_remote_agent(unb64(msg["agent_md"]))
            addr, length, dev = (int(x) for x in msg["region"])
            got = self.regions[i][key] = (addr, length, dev)
            self.remote_mem[i] = msg["mem_type"]
        return got

    def _register_sources(self, pieces: list[torch.Tensor]) -> None:
        # Each source storage is registered whole, once per update, and deregistered when the
        # update ends: pieces of one tensor travel in several buckets (and small tensors share
        # pages), and deregistering one bucket's memory while another's write is in flight
        # would pull the pages from under it.
        new = []
        for piece in pieces:
            storage = piece.untyped_storage()
            if storage.data_ptr() not in self._source_regs:
                whole = torch.empty(0, dtype=torch.uint8, device=piece.device).set_(storage)
                self._source_regs[storage.data_ptr()] = whole
                new.append(whole)
        if new:
            self._update_regs.append(self.agent.register_memory(new))

    def update_done(self) -> None:
        """Deregister the source memory of the update that just ended (every write is done or
        abandoned by then)."""
        for handles, _ in list(self._inflight.values()):
            for h in handles:
                self.agent.release_xfer_handle(h)
        self._inflight.clear()
        for reg in self._update_regs:
            self.agent.deregister_memory(reg)
        self._update_regs.clear()
        self._source_regs.clear()

    def _wait_done(self, handles: list[Any], seq: int, deadline: Deadline) -> None:
        """Poll (progressing UCX) until every write of bucket ``seq`` is done."""
        delay = 1e-5
        for i, h in enumerate(handles):
            while True:
                state = self.agent.check_xfer_state(h)
                if state == "DONE":
                    break
                if state == "ERR":
                    raise TransportError(
                        f"p2p: NIXL write of bucket {seq} to receiver {i} failed (did the "
                        "receiver die?)"
                    )
                deadline.check(f"NIXL write to receiver {i}")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def deliver(self, bucket: PackedBucket, deadline: Deadline) -> Finish:
        """Post one NIXL WRITE of the bucket per receiver; ``finish`` waits until NIXL reports
        every write done (the next bucket is packed meanwhile)."""
        n = bucket.manifest.nbytes
        seq = bucket.manifest.seq
        tag = f"miles:{self.current_version}:{seq}".encode()
        handles: list[Any] = []
        self._inflight[seq] = (handles, seq)
        if bucket.sources:  # zero copy: every non-empty piece, registered where it lies
            pairs = zip(bucket.manifest.pieces, bucket.sources, strict=True)
            moved = [(p, src) for p, src in pairs if p.nbytes]
            if moved and moved[0][1].device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if moved:
                self._register_sources([src for _, src in moved])
                local = self.agent.get_xfer_descs(
                    [region(src) for _, src in moved], mem_type(moved[0][1])
                )
        else:
            moved = [(None, bucket.data)] if n else []
            if bucket.data.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            local = self.agent.get_xfer_descs([region(bucket.data, n)], mem_type(bucket.data))

        def release() -> None:
            self._inflight.pop(seq, None)
            for h in handles:
                self.agent.release_xfer_handle(h)
            handles.clear()

        def wrapped(step: Callable[[], None]) -> None:
            try:
                step()
            except TransportError:
                release()
                raise
            except Exception as exc:  # NIXL raises its own types (e.g. a remote disconnect)
                release()
                raise TransportError(
                    f"p2p: NIXL write of bucket {seq} failed: {type(exc).__name__}: {exc} "
                    "(did a receiver die?)"
                ) from exc

        def post() -> None:
            targets = [self.remote_region(i, seq, n, deadline) for i in range(len(self.remotes))]
            for i, (addr, _, dev) in enumerate(targets):
                if not moved:  # nothing to write (empty tensors only): just say it is there
                    self.agent.send_notif(self.remotes[i], tag)
                    continue
                if bucket.sources:
                    spans = [(addr + p.offset, p.nbytes, dev) for p, _ in moved]
                else:
                    spans = [(addr, n, dev)]
                remote = self.agent.get_xfer_descs(spans, self.remote_mem[i])
                h = self.agent.initialize_xfer("WRITE", local, remote, self.remotes[i], tag)
                handles.append(h)
                if self.agent.transfer(h) == "ERR":
                    raise TransportError(f"p2p: posting the write of bucket {seq} to {i} failed")

        wrapped(post)

        def finish() -> list[dict[str, Any]]:
            wrapped(lambda: self._wait_done(handles, seq, deadline))
            release()
            return [{} for _ in self.remotes]

        return finish

    def close(self) -> None:
        """Close connections, forget the remote agents and deregister the buffers."""
        super().close()
        for name in self.remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # a dead peer cannot be disconnected cleanly; nothing to keep
                pass
        self.remotes.clear()
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()
        self.packer.buffers.clear()


class P2PTransport:
    """The registered ``p2p`` transport: a :class:`P2PSender` for the current set of engines,
    each of which takes part in an update through ``POST /miles/p2p_weights`` (its
    ``p2p_weights`` capability: the engine builds, once per sender, the
    :class:`~miles_transport_p2p.receiver.P2PReceiver` that connects back to
    :attr:`P2PSender.address`, and receives one update into its model).

    A new set of engines (one restarted), or a failed update, gets a new sender: the old one's
    connections and remote agents included an engine that is gone."""

    def __init__(self, options: P2POptions) -> None:
        from miles_transport_common import http

        self.options = options
        self.fanout = http.Fanout()
        self.sender: P2PSender | None = None
        self.engines: tuple[str, ...] = ()

    def _sender_for(self, urls: list[str]) -> P2PSender:
        if self.sender is None or tuple(urls) != self.engines:
            self._drop()
            self.sender = P2PSender(self.options, num_receivers=len(urls))
            self.engines = tuple(urls)
        return self.sender

    def _drop(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None
        self.engines = ()

    def send(
        self,
        weights: Any,
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Stream ``weights`` to every engine at ``engines`` and have each commit ``version``.
        With ``adapter`` the request also names it (``lora_name``, ``config_dict``): the engine
        receives the adapter's tensors the same way and commits them into that adapter."""
        from miles_transport_common import http

        urls = http.engine_urls(engines, "p2p")
        sender = self._sender_for(urls)
        body = {
            "options": self.options.model_dump(mode="json"),
            "address": list(sender.address),
            "version": version,
        }
        if adapter is not None:
            body.update(lora_name=adapter.name, config_dict=dict(adapter.config))
        timeout_s = self.options.timeout_s + 30

        def answer(url: str) -> dict[str, Any] | TransportError:
            # each engine's own answer, its refusal included: it names the engine (its URL)
            # and what it found wrong (a tensor that arrived or is served changed)
            try:
                return http.call(url, RECEIVER_ROUTE, body, timeout_s=timeout_s)
            except TransportError as exc:
                return exc

        wait = self.fanout.start([lambda u=u: answer(u) for u in urls])
        try:
            metrics = sender.send(weights, version=version)
        except TransportError as exc:
            # the engines' receivers see their connection close and give up at once
            self._drop()
            said = "; ".join(str(a) for a in wait() if isinstance(a, TransportError))
            raise TransportError(
                f"p2p transport: update {version} failed: {exc}"
                + (f" (engines: {said})" * bool(said))
            ) from exc
        refused = [a for a in wait() if isinstance(a, TransportError)]
        if refused:
            self._drop()
            raise TransportError(
                f"p2p transport: an engine did not confirm update {version}: {refused[0]}"
            ) from refused[0]
        return metrics

    def close(self) -> None:
        """Close the sender and the worker threads (idempotent)."""
        self._drop()
        self.fanout.close()


def build(options: P2POptions) -> P2PTransport:
    """Factory of the registered ``p2p`` transport: the sending side."""
    return P2PTransport(options)
