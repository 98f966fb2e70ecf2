"""The engine side of the p2p transport."""

from __future__ import annotations

import time
from typing import Any

import torch
from miles_transport_common.bucketing import Manifest
from miles_transport_common.errors import BucketRejected
from miles_transport_common.session import SocketReceiver

from miles_transport_p2p.agent import b64, mem_type, new_agent, region, unb64
from miles_transport_p2p.config import P2POptions


class P2PReceiver(SocketReceiver):
    """Registers ``num_buffers`` bucket slots with NIXL; the sender writes each bucket into a
    slot, then announces it. The receiver waits for NIXL's notification of that write, verifies
    the bucket in place, stages or loads its tensors, and acks so the slot can be reused."""

    transport = "p2p"

    def __init__(self, options: P2POptions, address: tuple[str, int], *, version: int = 0) -> None:
        super().__init__(options, address, version=version, device=options.device)
        self.agent = new_agent("receiver", options.nixl_backend)
        self.slots = [
            torch.zeros(options.bucket_bytes, dtype=torch.uint8, device=options.device)
            for _ in range(options.num_buffers)
        ]
        self._reg = self.agent.register_memory(self.slots)
        self._notifs: set[bytes] = set()
        self.sender_agent: str | None = None
        self.idle = self._progress  # the agent has no progress thread: progress while waiting

    def _progress(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            self._notifs.update(msgs)

    def hello(self) -> dict[str, Any]:
        """Our agent metadata and the addresses of our registered slots."""
        return {
            "agent_md": b64(self.agent.get_agent_metadata()),
            "slots": [list(region(s)) for s in self.slots],
            "mem_type": mem_type(self.slots[0]),
        }

    def connect(self) -> None:
        """Connect, then load the sender's agent metadata."""
        first = self.conn is None
        super().connect()
        if first:
            self.sender_agent = self.agent.add_remote_agent(unb64(self.welcome["agent_md"]))

    def bucket_data(self, msg: dict[str, Any], manifest: Manifest) -> torch.Tensor:
        """Wait for the write's notification, then view the slot."""
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
        slot = int(msg["slot"])
        if not 0 <= slot < len(self.slots) or manifest.nbytes > self.slots[slot].numel():
            raise BucketRejected(f"bucket {manifest.seq}: bad slot {slot} or size")
        return self.slots[slot][: manifest.nbytes]

    def close(self) -> None:
        """Close the connection and deregister the slots."""
        super().close()
        if self.sender_agent is not None:
            try:
                self.agent.remove_remote_agent(self.sender_agent)
            except Exception:  # the sender may be gone already
                pass
            self.sender_agent = None
        self.agent.deregister_memory(self._reg)


def build_receiver(options: P2POptions, address: tuple[str, int], rank: int) -> P2PReceiver:
    """The engine side, as ``Transport.receiver_factory`` builds it (``rank`` is 1-based)."""
    return P2PReceiver(options, address)
