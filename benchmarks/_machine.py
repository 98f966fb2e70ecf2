"""What every benchmark prints first: its settings and the machine it ran on."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def describe(settings: dict[str, Any], file: Any = None) -> None:
    """Print one ``settings: ... | machine: ...`` line (stdout unless ``file`` is given)."""
    try:
        import torch

        threads = f"torch {torch.__version__}, {torch.get_num_threads()} torch threads"
    except ImportError:
        threads = "no torch"
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"settings: {settings} | machine: {cpus} CPUs ({usable} usable), {threads}, "
        f"{platform.machine()}, Python {platform.python_version()}, load average {load:.2f}",
        file=file or sys.stdout,
        flush=True,
    )
