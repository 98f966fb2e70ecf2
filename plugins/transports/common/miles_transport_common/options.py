"""Options shared by every transport; each transport's config model extends this one."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core.hosts import resolve_host


class TransportOptions(BaseModel):
    """Options common to the colocated, broadcast and p2p transports."""

    model_config = ConfigDict(extra="forbid")

    bucket_size_mb: float = Field(
        512, gt=0, description="bound of one bucket (flat byte buffer), in MiB"
    )
    timeout_s: float = Field(
        120.0, gt=0, description="limit of every single wait (connect, bucket, commit)"
    )
    host: str | None = Field(
        None,
        description="address the sender listens on (broadcast: the group's store; p2p: the side "
        "channel); the engines must reach it. Default: the address of the sender's node "
        "(127.0.0.1 on one machine)",
    )
    port: int = Field(0, ge=0, le=65535, description="port the sender listens on; 0 = any free")
    staging: Literal["full", "bucket"] = Field(
        "full",
        description=(
            "'full': receivers stage the whole update and load it only when every bucket "
            "arrived and verified (atomic; one extra model copy of receiver memory); 'bucket': "
            "receivers load each verified bucket at once (memory bounded by a bucket, but a "
            "failure mid-update leaves the target partly updated and marked inconsistent)"
        ),
    )
    verify_weights_hash: bool = Field(
        False,
        description="also compare the weights hash of the whole stream on both sides before "
        "committing (one more pass over the bytes on each side)",
    )

    verify_served: bool = Field(
        True,
        description="after each commit the engine checks that it serves exactly the tensors "
        "sent (each tensor's checksum), refusing the commit and naming the tensor otherwise. "
        "Free where the engine serves from the memory verified on arrival (full staging); a "
        "copying load (staging='bucket') hashes the served weights once more. Every bucket is "
        "verified on arrival, tensor by tensor, either way",
    )

    @property
    def listen_host(self) -> str:
        """:attr:`host`, or the sender's node address (``miles_core.hosts.node_address``)."""
        return resolve_host(self.host)

    @property
    def bucket_bytes(self) -> int:
        """The bucket bound in bytes."""
        return max(1, int(self.bucket_size_mb * (1 << 20)))
