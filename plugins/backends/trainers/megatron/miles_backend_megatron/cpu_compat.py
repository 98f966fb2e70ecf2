"""The CPU-compatibility patches of the Megatron backend: the only monkey-patching it does.

``megatron-core`` is written for CUDA. On a machine where torch has no CUDA, two calls it makes
in every forward fail; :func:`apply` replaces them, once per process, and does nothing when
CUDA is available (on a GPU every Megatron call runs unpatched). Each patch says what it
replaces and why. The third CPU need, an explicit causal mask, is not a patch: the backend
always passes the mask (``miles_backend_megatron.model``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_applied = False


class NullRNGTracker:
    """Stands in for Megatron's ``CudaRNGStatesTracker`` on CPU.

    Megatron forks a separate CUDA RNG stream around dropout in tensor-parallel regions (so that
    TP ranks draw the same or different masks on purpose); the tracker's ``add`` and ``fork``
    call ``torch.cuda.get_rng_state``/``set_rng_state``, which fail without CUDA. The backend
    runs with dropout off (the log-probs a gradient is taken at must equal the recomputed
    ones), so on CPU no random number is drawn in those regions: forking is a no-op.
    """

    def reset(self) -> None:
        """Nothing to forget."""

    def get_states(self) -> dict[str, Any]:
        """No stream is tracked."""
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        """Nothing to restore."""

    def add(self, name: str, seed: int) -> None:
        """Megatron seeds its named streams at set-up: nothing to seed on CPU."""

    def is_initialized(self) -> bool:
        """Megatron asks before seeding."""
        return True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block on the default (CPU) generator."""
        yield


def needed() -> bool:
    """True on a machine where torch has no CUDA device: the patches are needed."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Apply the patches when :func:`needed`; returns whether they are in force."""
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    # 1. torch.cuda.current_device: Megatron places tensors it creates in the forward (rotary
    #    inverse frequencies, sequence offsets, RNG seeds) with
    #    ``device=torch.cuda.current_device()``, which raises "Torch not compiled with CUDA
    #    enabled". Without CUDA the current device is the CPU.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    # 2. Megatron's CUDA RNG tracker (see NullRNGTracker): installed as the tracker that
    #    ``get_cuda_rng_tracker()`` returns, marked initialised so Megatron does not build its
    #    CUDA one.
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._CUDA_RNG_STATE_TRACKER = NullRNGTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _applied = True
    return True
