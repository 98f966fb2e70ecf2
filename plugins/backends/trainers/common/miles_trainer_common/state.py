"""RNG states and tensor hashes: what a trainer's checkpoint and fingerprint are made of."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import Tensor


def hash_tensor(h: Any, t: Tensor) -> None:
    """Feed ``t``'s dtype, element count and bytes (on CPU, contiguous) to the hash ``h``
    (a ``hashlib`` object): equal updates mean bitwise-equal tensors."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(f"{t.dtype}{t.numel()}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: ``python`` (``random``), ``torch`` (CPU), ``numpy`` (when
    numpy is installed) and, on a CUDA ``device``, that device's ``cuda`` state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (the ``cuda`` state only on a CUDA
    ``device``)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
