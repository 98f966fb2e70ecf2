"""What a terminal sandbox may do: the limits every command of an episode runs under, the
isolation properties and the mechanisms (layers) that provide them."""

from __future__ import annotations

import os
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

Property = Literal["filesystem", "network", "processes"]
Layer = Literal[
    "netns",
    "pidns",
    "userns",
    "uid",
    "landlock",
    "landlock-tcp",
    "seccomp",
    "rlimit-shared",
    "cgroup",
    "tmpfs",
]
PROPERTIES: tuple[Property, ...] = get_args(Property)
ALL_LAYERS: tuple[Layer, ...] = get_args(Layer)
DEFAULT_READABLE = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/proc",
)
# /dev is not readable as a folder: listing it, or reading what the host keeps there
# (/dev/shm is world-readable and often shared between processes), would reach outside. These
# device files are granted one by one; /dev/fd and /dev/std* are links into /proc/self/fd.
DEFAULT_DEVICES = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
)


class SandboxLimits(BaseModel):
    """Limits of one sandbox; every command of the episode runs under them."""

    model_config = ConfigDict(extra="forbid")
    wall_s: float = Field(10.0, gt=0, description="wall-clock seconds per command")
    cpu_s: int = Field(5, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=16, description="address space per process (RLIMIT_AS)")
    total_memory_mb: int = Field(
        1024, ge=16, description="memory of all the sandbox's processes together (cgroup)"
    )
    disk_mb: int = Field(
        128, ge=1, description="size of the scratch directory (a tmpfs, when root)"
    )
    max_processes: int = Field(
        32,
        ge=2,
        description="processes alive at once (RLIMIT_NPROC in the sandbox's own uid "
        "or user namespace)",
    )
    max_output_bytes: int = Field(
        64 * 1024, ge=1024, description="stdout and stderr kept per command; more stops it"
    )
    linger_s: float = Field(
        0.5,
        ge=0,
        description="after a command exits, how long the processes it left may finish before "
        "they are killed (a background fork bomb shows itself meanwhile)",
    )
    max_file_mb: int = Field(64, ge=1, description="largest file a command may write")
    allow_unisolated: list[Property] = Field(
        default_factory=list,
        description="properties the sandbox may run without when no mechanism works here "
        "(never by default)",
    )
    disable_layers: list[Layer] = Field(
        default_factory=list, description="mechanisms not to use (to test each layer alone)"
    )
    readable: list[str] = Field(
        default_factory=lambda: list(DEFAULT_READABLE),
        description="folders the sandbox may read and execute from",
    )
    devices: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DEVICES),
        description="device files the sandbox may open for reading and writing (files only: "
        "/dev itself cannot be listed)",
    )
    uid_base: int = Field(
        61000, ge=1000, description="first dedicated uid tried when running as root"
    )

    @field_validator("readable")
    @classmethod
    def _no_dev_folder(cls, value: list[str]) -> list[str]:
        # A readable folder that holds /dev would list it and open /dev/shm again: devices are
        # granted one file at a time through ``devices``.
        for folder in value:
            norm = os.path.normpath(folder)
            if norm == "/" or norm == "/dev" or norm.startswith("/dev/"):
                raise ValueError(
                    f"readable: {folder!r} would expose /dev; grant device files through "
                    "`devices` instead"
                )
        return value
