"""The CPU-compatibility patches of the Megatron backend: the only monkey-patching it does.

``megatron-core`` is written for CUDA. On a machine where torch has no CUDA, two calls it makes
in every forward fail; :func:`apply` replaces them, once per process, and does nothing when
CUDA is available (on a GPU every Megatron call runs unpatched). Each patch says what it
replaces and why. The third CPU need, an explicit causal mask, is not a patch: the backend
always passes the mask (``miles_backend_megatron.model``). Megatron's distributed optimizer
(``backend.distributed_optimizer``) runs its calls under :func:`optimizer_calls`, a scope and
not a process-wide patch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

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


class _CudaNamesOnCpu(TorchFunctionMode):
    """The torch function mode of :func:`optimizer_calls`: a tensor Megatron's optimizer asks
    for on ``device='cuda'`` is made on the CPU, and ``Tensor.type()`` (no argument) of a CPU
    tensor answers with the CUDA type name (``torch.cuda.FloatTensor``)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*args, **kwargs)
        if (
            func is torch.Tensor.type
            and len(args) == 1
            and not kwargs
            and isinstance(out, str)
            and out.startswith("torch.")
            and not out.startswith("torch.cuda.")
        ):
            out = "torch.cuda." + out[len("torch.") :]
        return out


def optimizer_calls() -> contextlib.AbstractContextManager[Any]:
    """The scope of a call into Megatron's distributed optimizer (its construction, step,
    gradient norm and clipping): on a machine without CUDA, :class:`_CudaNamesOnCpu`; with
    CUDA, nothing (the calls run unpatched).

    3. Megatron's optimizer makes its flags and norms with ``device='cuda'``
       (``MixedPrecisionOptimizer.__init__``: ``torch.tensor([0], dtype=torch.int,
       device='cuda')``; ``clip_grads.get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``;
       ``utils.local_multi_tensor_l2_norm``, its norm without Apex or Transformer Engine): those
       tensors are made on the CPU instead.
    4. ``DistributedOptimizer._build_model_and_main_param_groups`` accepts a parameter only if
       ``param.type()`` is ``torch.cuda.FloatTensor`` (or half/bfloat16), and
       ``clip_grad_by_total_norm_fp32`` asserts it of each gradient: inside the scope a CPU
       tensor answers with the CUDA name of its type, so float32 parameters take the float32
       path they take on a GPU (the shard of each parameter is a view of it).

    A mode rather than patches of those functions: it reaches the five places without copying
    Megatron's code, and only for the duration of an optimizer call (the forward and the
    backward run outside it)."""
    if not needed():
        return contextlib.nullcontext()
    return _CudaNamesOnCpu()
