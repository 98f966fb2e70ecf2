"""The trainer side of the p2p transport."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from miles_transport_common.bucketing import PackedBucket
from miles_transport_common.deadline import Deadline
from miles_transport_common.errors import TransportError
from miles_transport_common.session import FaultHook, Finish, SocketSender

from miles_transport_p2p.agent import b64, mem_type, new_agent, region, unb64
from miles_transport_p2p.config import P2POptions


class P2PSender(SocketSender):
    """Packs buckets into ``num_buffers`` NIXL-registered buffers and writes each one into the
    matching registered slot of every receiver (one NIXL WRITE per receiver, with a
    notification the receiver waits for before reading the slot)."""

    transport = "p2p"

    def __init__(self, options: P2POptions, *, fault_hook: FaultHook | None = None) -> None:
        self.agent = new_agent("sender", options.nixl_backend)
        self._regs: list[Any] = []
        self.remotes: list[str] = []
        self.remote_slots: list[list[tuple[int, int, int]]] = []
        self.remote_mem: list[str] = []
        self.version = 0
        super().__init__(
            options, num_buffers=options.num_buffers, device=options.device, fault_hook=fault_hook
        )
        self.idle = self._progress  # the agent has no progress thread: progress while waiting

    def _progress(self) -> None:
        self.agent.get_new_notifs()  # drives the UCX worker; the sender expects no notifications

    def allocate(self, slot: int, nbytes: int) -> torch.Tensor:
        """A bucket buffer registered with NIXL."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.options.device)  # type: ignore[attr-defined]
        self._regs.append(self.agent.register_memory(buf))
        return buf

    def welcome(self, index: int, hello: dict[str, Any]) -> dict[str, Any]:
        """Load the receiver's agent metadata and slot addresses; reply with ours."""
        slots = [tuple(s) for s in hello["slots"]]
        if len(slots) < self.options.num_buffers or any(  # type: ignore[attr-defined]
            s[1] < self.options.bucket_bytes for s in slots
        ):
            raise TransportError(
                f"p2p receiver {index} registered {len(slots)} slot(s) smaller than the sender's "
                "buckets; both sides must use the same bucket_size_mb and num_buffers"
            )
        self.remotes.append(self.agent.add_remote_agent(unb64(hello["agent_md"])))
        self.remote_slots.append(slots)  # type: ignore[arg-type]
        self.remote_mem.append(hello["mem_type"])
        return {"agent_md": b64(self.agent.get_agent_metadata())}

    def deliver(self, bucket: PackedBucket, deadline: Deadline) -> Finish:
        """Post one NIXL WRITE of the bucket per receiver; ``finish`` waits until NIXL reports
        every write done (the next bucket is packed meanwhile)."""
        if bucket.data.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        n = bucket.manifest.nbytes
        seq = bucket.manifest.seq
        local = self.agent.get_xfer_descs([region(bucket.data, n)], mem_type(bucket.data))
        tag = f"miles:{self.current_version}:{seq}".encode()
        handles: list[Any] = []

        def release() -> None:
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
            for i, remote_name in enumerate(self.remotes):
                addr, _, dev = self.remote_slots[i][bucket.slot]
                remote = self.agent.get_xfer_descs([(addr, n, dev)], self.remote_mem[i])
                h = self.agent.initialize_xfer("WRITE", local, remote, remote_name, tag)
                handles.append(h)
                if self.agent.transfer(h) == "ERR":
                    raise TransportError(f"p2p: posting the write of bucket {seq} to {i} failed")

        def wait() -> None:
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

        wrapped(post)

        def finish() -> list[dict[str, Any]]:
            wrapped(wait)
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


def build(options: P2POptions) -> P2PSender:
    """Factory of the registered ``p2p`` transport: the sending side."""
    return P2PSender(options)
