"""The engine side of the p2p transport."""

from __future__ import annotations

import time
from typing import Any

import torch
from miles_transport_common.bucketing import Manifest
from miles_transport_common.session import SocketReceiver

from miles_transport_p2p.agent import b64, mem_type, new_agent, region, unb64
from miles_transport_p2p.config import P2POptions


class P2PReceiver(SocketReceiver):
    """The sender writes each bucket straight into staging memory this receiver registered with
    NIXL, then announces it. In full staging every bucket of an update has its own region (per
    parity, so a model that adopted the last update keeps serving while the next one lands), so
    the staged tensors are views of the regions: no copy between the network and the model.
    In bucket staging ``num_buffers`` regions are used in turn.

    Regions are allocated and registered on the sender's first ``region`` request for them and
    kept across updates; the receiver waits for NIXL's notification of each write, acks, and
    verifies the bucket on its worker thread while the next one arrives."""

    transport = "p2p"

    def __init__(self, options: P2POptions, address: tuple[str, int], *, version: int = 0) -> None:
        self.agent = new_agent("receiver", options.nixl_backend)
        self._regs: list[Any] = []
        super().__init__(options, address, version=version, device=options.device)
        self.p2p = options
        self.owned_buckets = options.staging == "full"
        self._notifs: set[bytes] = set()
        self.sender_agent: str | None = None
        self.idle = self._progress  # the agent has no progress thread: progress while waiting

    def on_new_buffer(self, buf: torch.Tensor) -> None:
        """Register each new staging region with NIXL (once; kept across updates)."""
        self._regs.append(self.agent.register_memory(buf))

    def _progress(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            self._notifs.update(msgs)

    def hello(self) -> dict[str, Any]:
        """Our agent metadata, and our staging mode (it decides how our regions are used)."""
        return {"agent_md": b64(self.agent.get_agent_metadata()), "staging": self.p2p.staging}

    def connect(self) -> None:
        """Connect, then load the sender's agent metadata."""
        first = self.conn is None
        super().connect()
        if first:
            self.sender_agent = self.agent.add_remote_agent(unb64(self.welcome["agent_md"]))

    def _key(self, seq: int) -> tuple[int, int]:
        assert self.stager is not None
        if self.owned_buckets:
            return (self.stager.parity, seq)
        return (0, seq % self.p2p.num_buffers)

    def region(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Where the sender may write bucket ``seq`` of ``nbytes``: a registered region."""
        registered = len(self._regs)
        buf = self.pool.bucket(self._key(int(msg["seq"])), int(msg["nbytes"]))
        addr, _, dev = region(buf)
        reply = {
            "op": "region",
            "seq": int(msg["seq"]),
            "region": [addr, int(msg["nbytes"]), dev],
            "mem_type": mem_type(buf),
        }
        if len(self._regs) != registered:  # a new registration: the sender needs it described
            reply["agent_md"] = b64(self.agent.get_agent_metadata())
        return reply

    def bucket_data(self, msg: dict[str, Any], manifest: Manifest) -> torch.Tensor:
        """Wait for the write's notification, then view the region."""
        tag = f"miles:{self.current_version}:{manifest.seq}".encode()
        if manifest.seq == 0:  # forget notifications of earlier (aborted) updates
            mine = f"miles:{self.current_version}:".encode()
            self._notifs = {n for n in self._notifs if n.startswith(mine)}
        deadline = self._deadline(f"NIXL's notification of bucket {manifest.seq}")
        delay = 1e-5
        while tag not in self._notifs:
            self._progress()
            if tag in self._notifs:
                break
            deadline.check()
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        self._notifs.discard(tag)
        return self.pool.bucket(self._key(manifest.seq), manifest.nbytes)

    def close(self) -> None:
        """Close the connection and deregister the regions."""
        super().close()
        if self.sender_agent is not None:
            try:
                self.agent.remove_remote_agent(self.sender_agent)
            except Exception:  # the sender may be gone already
                pass
            self.sender_agent = None
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()


def build_receiver(options: P2POptions, address: tuple[str, int], rank: int) -> P2PReceiver:
    """The engine side, as ``Transport.receiver_factory`` builds it (``rank`` is 1-based)."""
    return P2PReceiver(options, address)
